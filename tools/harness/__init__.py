"""The benchmarks' harness, written once for bench/ and tests/ (bench/README.md): child processes and their RESULT
line, sampling with per-step timing, the machine and versions, result files, memory of the process tree, and the
options every benchmark's command line shares."""
