"""The C allocator under the sampler: glibc malloc's live settings, who could change them, and the pack's tune.

Why (docs/process_tax.md, issue #68): on an H200, plain eager steps got about 4 ms slower after the pack's
background compile, because ComfyUI's CPU `cond_cat` (2.5 MB a step) faulted in all 617 pages of a fresh output on
every call. glibc gives a large allocation fresh pages every call only in some states (thresholds frozen low by a
`mallopt` or `MALLOC_*_`, a low trim threshold, a thread's heap filled near its end, `malloc_trim` between calls).

- `glibc`: the live parameters (`mp_`) read in place, checked against `mallinfo2`; the glibc version.
- `chunk`: the chunk header of an allocation (mmapped? which arena?).
- `allocators`: a preloaded or mapped tcmalloc, jemalloc or mimalloc; whether `malloc` is glibc's.
- `importers`: the mapped libraries whose dynamic symbols import `mallopt` or `malloc_trim`.
- `report`: all of it for the doctor, with warnings.
- `tune`: the remedy (ACCEL_MALLOC_TUNE), applied once when Compile Model is first applied.
- `step_faults`: minor page faults per sampling step of the last sampling, for GET /accel/stats.

Everything reads "unknown" (None or {}) off Linux or off glibc, never raises.
"""
