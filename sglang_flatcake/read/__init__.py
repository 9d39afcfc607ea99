"""The read path: from keys to bytes in memory or in paged KV slots.

  planner.py     ReadPlan: which segment bytes to read, merged into commands
  restore.py     VectoredReader: a plan into one host buffer (staging)
  read_lease.py  ReadLease: the sessions a read holds against reclaim
  window.py      LayerWindow: two layers of buffers, fills and waits
  to_slots.py    restore_through_window: store -> window -> KV slots
  scatter.py     scatter kernels (host and device) from a window to slots
  checksum.py    block checksums in host or device memory
  device.py      the device interface: CudaDevice and EmulatedDevice
"""
