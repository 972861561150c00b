"""Export the compile cache to one file and import it on another machine of the same GPU and torch.

The file is a zip with a manifest of the environments, each with its Mega-Cache artifacts and torch's working
cache (`inductor/`). The artifacts alone rebuild torch's FX-graph and AOTAutograd entries (and, on CUDA, the
Triton kernels bundled in them), but on the CPU inductor's C++ kernels are compiled libraries next to those
entries that no artifact carries: without them an imported cache still runs the C++ compiler for every kernel.
Import checks each environment's fingerprint against this machine and skips, with the reason, what was built for
another torch, GPU, driver or CPU; it never overwrites a file that is already there.

The manifest lists every file with its SHA-256. Import checks the whole archive before it writes anything: every
name inside its environment's artifacts, `inductor/` or findings files (auto mode's per-kind shares and the kinds
found to compile only in pieces), every file's hash, every artifact's own checksum; one failure and nothing is
written. That catches a damaged or altered file, not a forged archive (whoever alters files can rewrite the
manifest): a compile cache is code, import only archives you built (README).
"""
from __future__ import annotations

import hashlib
import json
import zipfile
import zlib
from pathlib import Path

from .location import environment_id, fingerprint
from .store import FINDINGS_FILES, PRECOMPILED_DIR, environment_dirs, read_fingerprint, unpack_artifact, write_atomic

FORMAT = "comfyui-accel-compile-cache/2"  # /2: the manifest has each file's sha256
READABLE = (FORMAT, "comfyui-accel-compile-cache/1")


def export_cache(root: Path, destination: Path) -> dict:
    """Write every environment's artifacts under `root` to the zip `destination`; returns the manifest."""
    manifest = {"format": FORMAT, "environments": []}
    if destination.is_dir():
        raise ValueError(f"{destination} is a folder; name the file to write, e.g. {destination / 'accel-cache.zip'}")
    destination.parent.mkdir(parents=True, exist_ok=True)
    tmp = destination.with_name(destination.name + ".partial")
    try:
        _write_archive(root, tmp, manifest)
    except BaseException:
        tmp.unlink(missing_ok=True)  # nothing half-written left behind
        raise
    tmp.replace(destination)
    return manifest


def _write_archive(root: Path, tmp: Path, manifest: dict) -> None:
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as archive:
        for env_dir in environment_dirs(root):
            fingerprint = read_fingerprint(env_dir)
            if fingerprint is None:  # no import could check it against its machine (the next compile rewrites it)
                continue
            files, hashes = [], {}
            artifacts = env_dir / "artifacts"  # each key's artifacts, and its precompiled functions (store.py)
            for path in sorted([*artifacts.glob("*/*.bin"), *artifacts.glob(f"*/{PRECOMPILED_DIR}/*.bin")]):
                _add(archive, root, path, files, hashes, check=unpack_artifact)
            for path in sorted((env_dir / "inductor").rglob("*")):
                if path.is_file() and not path.is_symlink() and "locks" not in path.parts and \
                        not path.name.startswith(".tmp"):
                    _add(archive, root, path, files, hashes)  # <env id>/inductor/...
            for findings in (env_dir / name for name in FINDINGS_FILES):
                if findings.is_file():  # auto mode decides each kind as on the exporting machine
                    # a damaged one (the pack reads it as none, and measures again) is left out: import refuses it
                    _add(archive, root, findings, files, hashes, check=_findings_table)
            manifest["environments"].append({"env_id": env_dir.name, "files": files, "sha256": hashes,
                                             "fingerprint": fingerprint})
        archive.writestr("manifest.json", json.dumps(manifest, indent=1))


def _add(archive: zipfile.ZipFile, root: Path, path: Path, files: list, hashes: dict, check=None) -> None:
    """`path` into the archive under its name below `root`, read once: the bytes hashed for the manifest are the
    bytes archived, also while a running ComfyUI writes or evicts files meanwhile (a file gone by then is left
    out, and so is one `check` refuses: a damaged artifact is not worth carrying to another machine)."""
    try:
        data = path.read_bytes()
        if check is not None:
            check(data)
    except (FileNotFoundError, ValueError):
        return
    name = path.relative_to(root).as_posix()
    archive.writestr(name, data)
    files.append(name)
    hashes[name] = hashlib.sha256(data).hexdigest()


def _findings_table(data: bytes) -> None:
    if not isinstance(json.loads(data), dict):
        raise ValueError("not a table of findings")


# What a damaged or truncated archive raises while it is read (a bad CRC, a cut stream, a manifest of another shape)
DAMAGED = (zipfile.BadZipFile, zlib.error, EOFError, KeyError, TypeError, AttributeError)


def import_cache(root: Path, source: Path, device_types: tuple[str, ...]) -> list[str]:
    """Add the artifacts in `source` whose environment matches this machine. Returns one line per environment
    saying what was imported or why it was skipped; existing entries are kept."""
    if not source.is_file():
        raise ValueError(f"{source} {'is a folder' if source.is_dir() else 'does not exist'}: name the file "
                         "`python -m accel cache export FILE` wrote")
    try:
        archive = zipfile.ZipFile(source)
    except (OSError, zipfile.BadZipFile) as err:
        raise ValueError(f"{source} is not a compile cache exported by `python -m accel cache export` ({err})")
    with archive:
        try:
            wanted, report = _checked(archive, source, device_types)
        except DAMAGED as err:
            raise ValueError(f"{source} is damaged or cut short ({type(err).__name__}: {err}); export it again. "
                             "Nothing was imported.") from None
        for env in wanted:  # the whole archive checked: now written
            write_atomic(root / env["env_id"] / "fingerprint.json", json.dumps(env["fingerprint"], indent=1).encode())
            imported = 0
            for name in env["files"]:
                data = archive.read(name)
                if _is_findings(name):  # merged: what this machine found itself wins
                    imported += _merge_findings(root / name, data)
                    continue
                target = root / name
                if not target.exists():
                    write_atomic(target, data)
                    imported += 1
            report.append(f"imported {imported} new files for {env['env_id']} "
                          f"({len(env['files']) - imported} already present)")
        return report


def _checked(archive: zipfile.ZipFile, source: Path, device_types: tuple[str, ...]) -> tuple[list, list]:
    """The archive's environments for this machine, every entry of theirs checked (_check_entry), and the report
    lines of those skipped; before anything is written."""
    try:
        manifest = json.loads(archive.read("manifest.json"))
    except KeyError:
        raise ValueError(f"{source} has no manifest.json: it was not written by `python -m accel cache export`")
    except ValueError as err:
        raise ValueError(f"{source}: its manifest.json is damaged ({err}); export it again. Nothing was imported.")
    if manifest.get("format") not in READABLE:
        raise ValueError(f"{source} is format {manifest.get('format')!r}; this pack reads {FORMAT!r}")
    here = {environment_id(found): found for found in (fingerprint(t) for t in device_types)}
    report, wanted = [], []
    for env in manifest["environments"]:
        if env["env_id"] not in here:
            report.append(f"skipped {env['env_id']}: built for {_describe(env['fingerprint'])}, this machine is "
                          + " / ".join(_describe(f) for f in here.values()))
            continue
        for name in env["files"]:
            _check_entry(archive, source, env, name, manifest["format"] == FORMAT)
        wanted.append(env)
    return wanted, report


def _check_entry(archive: zipfile.ZipFile, source: Path, env: dict, name: str, hashed: bool) -> None:
    """Refuse (ValueError naming the entry) a name outside the environment's own files, a file whose hash is not
    the manifest's, or a damaged artifact: before anything is written."""
    parts = name.split("/")
    artifact = (len(parts) == 4 and parts[1] == "artifacts") or (
        len(parts) == 5 and parts[1] == "artifacts" and parts[3] == PRECOMPILED_DIR)
    findings = _is_findings(name)
    if parts[0] != env["env_id"] or not (artifact or findings or parts[1:2] == ["inductor"]) or \
            ".." in parts or "" in parts:
        raise ValueError(f"{source}: unexpected entry {name!r}; the file is damaged or not an export. Nothing "
                         "was imported.")
    try:
        data = archive.read(name)
    except KeyError:
        raise ValueError(f"{source}: {name!r} is in the manifest but not in the archive. Nothing was imported.")
    if hashed and hashlib.sha256(data).hexdigest() != env.get("sha256", {}).get(name):
        raise ValueError(f"{source}: {name!r} does not match the manifest's checksum: the archive was damaged or "
                         "changed after export. Nothing was imported.")
    try:
        if artifact:
            unpack_artifact(data)  # refuse a damaged file here rather than at a prompt
        if findings and not isinstance(json.loads(data), dict):
            raise ValueError("not a table of findings")
    except ValueError as err:
        raise ValueError(f"{source}: {name!r} is damaged ({err}). Nothing was imported.")


def _is_findings(name: str) -> bool:
    """An archive name `<env id>/<findings file>`: auto mode's findings per kind (store.FINDINGS_FILES)."""
    parts = name.split("/")
    return len(parts) == 2 and parts[1] in FINDINGS_FILES


def _merge_findings(target: Path, data: bytes) -> int:
    try:
        incoming = json.loads(data)
    except ValueError as err:
        raise ValueError(f"{target.name} in the export is not valid JSON ({err})")
    if not isinstance(incoming, dict):
        raise ValueError(f"{target.name} in the export is not a table of findings")
    try:
        existing = json.loads(target.read_text()) if target.is_file() else {}
    except (OSError, ValueError):
        existing = {}  # a damaged local file: the imported findings replace it
    existing = existing if isinstance(existing, dict) else {}
    merged = {**incoming, **existing}
    if merged == existing:
        return 0
    write_atomic(target, json.dumps(merged, indent=1, sort_keys=True).encode())
    return 1


def _describe(found: dict) -> str:
    parts = [f"torch {found.get('torch')}", found.get("device", "?")]
    if found.get("gpu"):
        parts.append(f"{found['gpu']} sm_{found.get('capability')} driver {found.get('driver')}")
    return ", ".join(parts)
