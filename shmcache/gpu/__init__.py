"""GPU entries: CUDA IPC exports of device values, kept beside the host copy of the node layer,
and the routes by which other processes read them. The node layer does not import this package:
it stores the GPU record as an opaque attachment of the entry.

Who exports: the producing process. At commit it copies the value's CUDA arrays into a private
device buffer laid out like the value's host encoding, synchronises its current stream, and seals
the entry with a `GpuRecord` (the IPC handle of the buffer's allocation, the buffer's offset inside
it, and the exporter's identity). It keeps the buffer until the entry has left the index. The host
copy in the arena is always written as well: it serves dead exporters, GPUs without peer access,
processes without CUDA and the remote layer. A reader takes one `Route` (see `choose_route`); it
never opens the handle of a dead exporter.

Modules: record.py (`GpuRecord`, its attachment bytes, `withdraw_record`, `live_mask`), route.py
(`Route`, `ReaderDevice`, `choose_route`), driver.py (`CudaDriver`), mappings.py
(`DeviceMappings`), exports.py (`Exports`), tensors.py (what reads build CUDA values from) and
side.py (`DeviceSide`, a cache's GPU side).
"""
