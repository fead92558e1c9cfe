"""The supervisor process (``shmkv supervise``): the arena's only writer.

Everything in this package runs in that one process, on its selectors loop (``loop.py``)
or, for the slower tiers under ``tiers/``, on their writer threads. It never imports the
llama side: a supervisor has no model.
"""
