"""The benchmarks' harness, written once for bench/ and tests/ (bench/README.md): child processes and their RESULT
line, sampling with per-step timing and settings timed in rounds, the variants compared (core and the pack's
compile modes), the machine and versions, result files, tables and charts, memory of the process tree, and the
options every benchmark's command line shares."""
