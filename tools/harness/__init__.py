"""The benchmarks' harness, written once for bench/ and tests/: child processes and their RESULT line, memory of
the process tree, sampling with per-step timing, the machine and versions, result files."""
