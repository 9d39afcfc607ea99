"""HiCache mode (``--hicache-storage-backend flatcake``): the storage backend SGLang's HiCache
controller calls (``backend``), its host pages (``pages``), write-time signals from the radix
tree (``signals``), and the scheduling hooks that restore SSD blocks straight into device KV
slots (``scheduling``, ``direct``, ``decline``, ``recompute``, ``restore_use``)."""
