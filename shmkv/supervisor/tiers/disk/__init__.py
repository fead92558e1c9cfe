"""``--persist DIR``: the arena's records written behind to LMDB, and a new arena refilled
from it after a reboot (supervisor process, writer thread)."""
