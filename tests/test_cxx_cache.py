"""The test run's compiler cache (tools/cxx_cache.py) looks a build up by what g++ builds, not by where: the same
kernel built by two clones of the project (each with torch in its own environment, and so an inductor precompiled
header named after that folder) is one build; another flag or another source is another."""
from __future__ import annotations

from tools.cxx_cache import cached_call

REAL = "/usr/bin/g++"
KERNEL = b'extern "C" void kernel(float* out) { out[0] = 1.0f; }'


def build_key(monkeypatch, folder, clone: str, header: str, flags=("-O3", "-march=native"), source=KERNEL) -> str:
    """The cache's key of a kernel build as inductor's cpp_builder writes it (torch 2.11), by a clone at `clone`
    whose inductor cache is `folder`."""
    torch_dir = f"{clone}/.venv/lib/python3.11/site-packages/torch"
    monkeypatch.setenv("ACCEL_TEST_TORCH_DIR", torch_dir)  # as tests/conftest.py sets it for the run
    (folder / "ab").mkdir(parents=True, exist_ok=True)
    (folder / "ab" / "kernel.main.cpp").write_bytes(source)
    args = [str(folder / "ab" / "kernel.main.cpp"), "-D", "TORCH_INDUCTOR_CPP_WRAPPER", "-shared", "-fPIC", *flags,
            "-include", f"/tmp/torchinductor_root/precompiled_headers/{header}.h",
            f"-I{torch_dir}/include", f"-I{torch_dir}/include/torch/csrc/api/include", f"-L{torch_dir}/lib",
            "-ltorch", "-o", str(folder / "ab" / "kernel.main.so")]
    key, output = cached_call(REAL, args)
    assert output == str(folder / "ab" / "kernel.main.so")
    return key


def test_two_clones_share_a_build_and_another_flag_or_source_does_not(tmp_path, monkeypatch):
    here = build_key(monkeypatch, tmp_path / "run1", "/work/main", "ckac4hicd77")
    assert build_key(monkeypatch, tmp_path / "run2", "/tmp/ci-clone", "c2tidq46csr") == here, \
        "a fresh clone of the project builds again what an earlier run built"
    assert build_key(monkeypatch, tmp_path / "run3", "/work/main", "ckac4hicd77",
                     flags=("-O3", "-march=native", "-mavx2")) != here
    assert build_key(monkeypatch, tmp_path / "run4", "/work/main", "ckac4hicd77", source=KERNEL + b"\n") != here


def test_a_call_without_one_source_and_an_output_is_not_cached():
    assert cached_call(REAL, ["--version"]) is None
    assert cached_call(REAL, ["a.o", "b.o", "-shared", "-o", "lib.so"]) is None  # a link: g++ itself
