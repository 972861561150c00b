"""A compiler cache for the test run, as ccache is in CI: tests/conftest.py puts a `g++` that runs this file first on
PATH, for the test processes and every process they start (servers, probes, background children).

Each test whose compile cache starts empty makes inductor build the same C++ again: its check programs for the
CPU's vector instructions (in every new process), the header it preprocesses for its precompiled header, and the
kernels of the models every test shares. A call with one source (.cpp, or inductor's .hpp) and an output is looked
up by the source's bytes and the command line, the two files' own names and folders left out (they differ between
caches: inductor names them after their content), and so are torch's folder, $ACCEL_TEST_TORCH_DIR, and the name
of inductor's precompiled header, which inductor derives from that folder too (each clone of the project installs
the same torch into an environment of its own; the kept folder's name says which torch); a hit copies the output
kept from the first call, byte for byte what g++ wrote; a miss runs g++ and keeps its output. Every other call
(--version, a link of objects) is g++ itself.
torch and its caches see a compiler that answered; what they count (cold graphs, cache hits) is unchanged.

$ACCEL_TEST_CXX_CACHE is the cache folder (kept between test runs: tests/conftest.py), $ACCEL_TEST_REAL_CXX the
compiler. Each cached call appends a line to $ACCEL_TEST_CXX_LOG (the run's): "hit", or "miss <seconds>", then what
it built ("header" for inductor's precompiled header, which every process that compiles or loads C++ kernels
builds, else "source"), then the test that started it (pytest's PYTEST_CURRENT_TEST, which the processes a test
starts inherit), the test process (pytest-xdist's worker) and the time it ended, so that a run's compile time and
builds can be read per test. A long-lived process (a background compile worker, a module's server) keeps the test
that started it: the worker and the time, with the run's `test-times.log` (tests/conftest.py), tell the test
running then. A hit refreshes the kept file's time, by which old builds are pruned.
"""
import hashlib
import os
import sys
import time


def cached_call(real: str, args: list[str]) -> tuple[str, str] | None:
    """(key, output) of a call with one source and an output, else None."""
    sources = [a for a in args if a.endswith((".cpp", ".hpp"))]
    if len(sources) != 1 or "-o" not in args or args.index("-o") + 1 >= len(args):
        return None
    source, output = sources[0], args[args.index("-o") + 1]
    folders = [(os.path.dirname(source), "<source folder>"), (os.path.dirname(output), "<output folder>"),
               (os.environ.get("ACCEL_TEST_TORCH_DIR", ""), "<torch>")]
    line = [real]
    for before, arg in zip(["", *args], args):
        if arg in (source, output):
            arg = "<source>" if arg == source else "<output>"
        if before == "-include" and os.path.basename(os.path.dirname(arg)) == "precompiled_headers":
            arg = "<precompiled header>"  # named after torch's folder too; built from the same headers and flags
        for folder, name in folders:
            if folder:
                arg = arg.replace(folder, name)
        line.append(arg)
    with open(source, "rb") as f:
        return hashlib.sha256(f.read() + b"\0" + "\0".join(line).encode()).hexdigest(), output


def copy(src: str, dst: str) -> None:
    """Through a temporary name and a rename, so a reader (another process) never sees half a file."""
    tmp = f"{dst}.tmp-{os.getpid()}"
    with open(src, "rb") as f, open(tmp, "wb") as g:
        g.write(f.read())
    os.chmod(tmp, 0o755)
    os.replace(tmp, dst)


def reuse(kept: str, output: str) -> bool:
    """Copy the kept build to `output` and refresh its time; False when there is none (or a run starting in the
    other test process just pruned it: then the compiler builds it again)."""
    try:
        copy(kept, output)
        os.utime(kept)
    except OSError:
        return False
    return True


def main() -> int:
    real, cache, args = os.environ["ACCEL_TEST_REAL_CXX"], os.environ["ACCEL_TEST_CXX_CACHE"], sys.argv[1:]
    found = cached_call(real, args)
    if found is None:
        os.execv(real, [real, *args])
    key, output = found
    kept = os.path.join(cache, key + os.path.splitext(output)[1])
    if reuse(kept, output):
        outcome = "hit"
        code = 0
    else:
        import subprocess

        start = time.perf_counter()
        code = subprocess.call([real, *args])
        outcome = f"miss {time.perf_counter() - start:.2f}"
        if code == 0 and os.path.isfile(output):
            copy(output, kept)
    test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
    built = "header" if any(a.endswith(".hpp") for a in args) else "source"
    worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
    with open(os.environ.get("ACCEL_TEST_CXX_LOG") or os.path.join(cache, "calls.log"), "a") as log:
        log.write(f"{outcome} {built} {test} {worker} {time.time():.1f}\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
