"""Slower storage behind the arena, run in the supervisor: ``base.py`` is the write-behind
every tier shares (a bounded queue and a writer thread per tier), ``loop.py`` its side of the
supervisor loop, ``disk/`` the LMDB tier (``--persist``) and ``redis/`` the Redis / Valkey
tier (``--remote``)."""
