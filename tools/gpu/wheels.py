"""The wheels the bare CUDA image lacks, and the proof that they are enough.

The GPU acceptance check runs on an image (tools/gpu/image_packages.txt) that has torch,
CUDA and most of the scientific stack, but not torchtitan, torchao, datasets, tyro,
torchdata, tomli or tomli-w, and no network. What it lacks travels as wheels for CPython
3.12 on manylinux x86-64, named in `wheels.lock.json` (name, version, file, sha256,
bytes, and the wheel's own Requires-Dist, so the closure can be checked offline).

    python tools/gpu/wheels.py download DIR   # the locked wheels + this project's, manifest.json
    python tools/gpu/wheels.py lock           # re-resolve against the image (needs PyPI)
    python tools/gpu/wheels.py verify DIR     # sha256 of every wheel against DIR/manifest.json
    python tools/gpu/wheels.py installed      # the closure against what this Python has

`closure_problems` is the resolver: starting from this project's dependencies, every
requirement (markers evaluated for the image's Python) must be met by the image's
packages or by a locked wheel, whose own requirements are followed in turn.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import Tag
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
IMAGE_PACKAGES = HERE / "image_packages.txt"
LOCK = HERE / "wheels.lock.json"
MANIFEST = "manifest.json"
#: What may travel with the working tree to the device machine, wheels and all.
MAX_BYTES = 64 * 2**20
#: Never carried: the image's own torch stack must stay the one that runs.
NEVER_CARRIED = ("torch", "triton", "torchvision", "torchaudio")
NEVER_CARRIED_PREFIXES = ("nvidia-", "cuda-")

#: The image's interpreter, for markers and wheel tags (Python 3.12.3, glibc 2.39: Ubuntu 24.04).
IMAGE_PYTHON = "3.12.3"
IMAGE_GLIBC = (2, 39)
MARKER_ENV = {
    "python_version": "3.12", "python_full_version": IMAGE_PYTHON, "implementation_name": "cpython",
    "implementation_version": IMAGE_PYTHON, "platform_python_implementation": "CPython",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
    "platform_release": "", "platform_version": "", "extra": "",
}
#: `pip download` flags for those wheels (pip matches each manylinux_2_N tag literally).
PIP_PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                *[arg for n in (39, 35, 34, 31, 28, 27, 24, 17) for arg in ("--platform", f"manylinux_2_{n}_x86_64")],
                "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64"]


# --- what the image has, what a wheel needs ------------------------------------------------------

def image_packages(path: Path = IMAGE_PACKAGES) -> dict[str, Version | None]:
    """Canonical name -> version (None where the list does not say)."""
    packages = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            packages[canonicalize_name(name)] = Version(version) if version else None
    return packages


def image_tags() -> set[Tag]:
    """Wheel tags the image's CPython 3.12 on x86-64 Linux accepts."""
    interpreters = ["cp312", *(f"cp3{m}" for m in range(2, 13))]
    platforms = ["linux_x86_64", "manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
                 *(f"manylinux_2_{n}_x86_64" for n in range(5, IMAGE_GLIBC[1] + 1))]
    tags = {Tag("cp312", "cp312", p) for p in platforms}
    tags |= {Tag(i, "abi3", p) for i in interpreters for p in platforms}
    tags |= {Tag(i, "none", p) for i in ["cp312", "py3", "py312"] for p in ["any", *platforms]}
    return tags


def wheel_fits_image(filename: str) -> bool:
    """Whether pip on the image would install this wheel file."""
    _, _, _, tags = parse_wheel_filename(filename)
    return bool(set(tags) & image_tags())


def wheel_requires(path: Path) -> list[str]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def project_requires() -> list[str]:
    """This project's own dependencies (pyproject.toml), the root of the closure."""
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


def applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate(MARKER_ENV)


# --- the resolver ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Problem:
    requirement: str
    needed_by: str
    why: str

    def __str__(self) -> str:
        return f"{self.requirement} (needed by {self.needed_by}): {self.why}"


def closure_problems(lock: dict, image: dict[str, Version | None] | None = None,
                     root: list[str] | None = None) -> list[Problem]:
    """Every requirement of the project's closure that neither the image nor the lock meets,
    and every locked wheel the image could not install. An image package of unknown
    version meets any version range (only the image can tell; `installed` checks there)."""
    image = image_packages() if image is None else image
    wheels = {canonicalize_name(w["name"]): w for w in lock["wheels"]}
    problems = [Problem(w["file"], "wheels.lock.json", "not a wheel for CPython 3.12 on manylinux x86-64")
                for w in lock["wheels"] if not wheel_fits_image(w["file"])]
    problems += [Problem(w["file"], "wheels.lock.json", "the image's torch stack is never carried")
                 for w in lock["wheels"] if is_never_carried(w["name"])]
    todo = [(r, "gamma-titan") for r in (project_requires() if root is None else root)]
    seen = set()
    while todo:
        text, parent = todo.pop()
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if not applies(req) or (name, str(req.specifier)) in seen:
            continue
        seen.add((name, str(req.specifier)))
        if name in wheels:
            version = Version(wheels[name]["version"])
            if not req.specifier.contains(version, prereleases=True):
                problems.append(Problem(text, parent, f"the locked wheel is {version}"))
            todo += [(r, name) for r in wheels[name]["requires"]]
        elif name in image:
            version = image[name]
            if version is not None and not req.specifier.contains(version, prereleases=True):
                problems.append(Problem(text, parent, f"the image has {version}"))
        else:
            problems.append(Problem(text, parent, "neither on the image nor among the wheels"))
    return problems


def is_never_carried(name: str) -> bool:
    name = canonicalize_name(name)
    return name in NEVER_CARRIED or name.startswith(NEVER_CARRIED_PREFIXES)


def installed_problems(lock: dict | None = None) -> tuple[list[str], list[str]]:
    """The closure against the packages this interpreter really has (run on the image after
    the install: versions the package list does not give are checked here), as (errors,
    warnings). An error is what would break a run: a package that this project or a carried
    wheel needs and that is not installed, or a carried wheel at another version than its
    requirement. A mismatch among the image's own packages (the pins inside torch's
    metadata, a version the image chose) is a warning: the image runs as it was built."""
    from importlib import metadata

    lock = json.loads(LOCK.read_text()) if lock is None else lock
    ours = {canonicalize_name(w["name"]) for w in lock["wheels"]} | {"gamma-titan"}
    errors, warnings = [], []
    todo, seen = [(r, "gamma-titan") for r in project_requires()], set()
    while todo:
        text, parent = todo.pop()
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if (req.marker is not None and not req.marker.evaluate({"extra": ""})) or (name, parent) in seen:
            continue
        seen.add((name, parent))
        needed_by_us = canonicalize_name(parent) in ours
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            (errors if needed_by_us else warnings).append(f"{text} (needed by {parent}): not installed")
            continue
        if not req.specifier.contains(Version(dist.version), prereleases=True):
            problem = f"{text} (needed by {parent}): {dist.version} is installed"
            (errors if name in ours else warnings).append(problem)
        if (name, None) not in seen:
            seen.add((name, None))
            todo += [(r, req.name) for r in dist.requires or []]
    return errors, warnings


# --- downloads -------------------------------------------------------------------------------------

def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pip_download(spec: str, dest: Path) -> Path:
    """One wheel (no dependencies) for the image's platform; its path."""
    before = set(dest.glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_PLATFORM, "-d", str(dest), spec],
                   check=True)
    new = set(dest.glob("*.whl")) - before
    name = canonicalize_name(spec.split("==")[0])
    matches = [p for p in new | before if canonicalize_name(parse_wheel_filename(p.name)[0]) == name]
    if len(matches) != 1:
        raise SystemExit(f"error: pip download {spec} gave {sorted(p.name for p in matches)}")
    return matches[0]


def entry(path: Path) -> dict:
    name, version, _, _ = parse_wheel_filename(path.name)
    return {"name": str(name), "version": str(version), "file": path.name, "sha256": sha256(path),
            "bytes": path.stat().st_size, "requires": wheel_requires(path)}


def lock(dest: Path | None = None) -> dict:
    """Re-resolve: every requirement of the closure that the image does not meet gets a wheel,
    at the version installed next to this script (the one the CPU suite runs), else PyPI's newest."""
    from importlib import metadata

    image = image_packages()
    wheels: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(tmp) if dest is None else dest
        todo = [(r, "gamma-titan") for r in project_requires()]
        while todo:
            text, parent = todo.pop()
            req = Requirement(text)
            name = canonicalize_name(req.name)
            if not applies(req) or name in wheels:
                continue
            if name in image and (image[name] is None or req.specifier.contains(image[name], prereleases=True)):
                continue
            if is_never_carried(name):
                raise SystemExit(f"error: {text} (needed by {parent}) is not met by the image's {image.get(name)}, "
                                 "and the image's torch stack is never carried")
            try:
                spec = f"{req.name}=={metadata.version(req.name)}"
            except metadata.PackageNotFoundError:
                spec = f"{req.name}{req.specifier}"
            wheels[name] = entry(pip_download(spec, dest))
            print(f"locked {wheels[name]['file']} (for {parent})", flush=True)
            todo += [(r, name) for r in wheels[name]["requires"]]
    result = {"about": "wheels the GPU image lacks (tools/gpu/wheels.py lock); requires = the wheel's Requires-Dist",
              "generated": date.today().isoformat(), "python": IMAGE_PYTHON,
              "wheels": sorted(wheels.values(), key=lambda w: w["name"].lower())}
    problems = closure_problems(result, image)
    if problems:
        raise SystemExit("error: the closure is not complete: " + "; ".join(map(str, problems)))
    return result


def download(dest: Path) -> None:
    """The locked wheels (sha256 checked) and this project's own wheel, plus manifest.json."""
    dest.mkdir(parents=True, exist_ok=True)
    locked = json.loads(LOCK.read_text())
    manifest = []
    for w in locked["wheels"]:
        path = dest / w["file"]
        if not path.exists() or sha256(path) != w["sha256"]:
            path.unlink(missing_ok=True)
            path = pip_download(f"{w['name']}=={w['version']}", dest)
        if path.name != w["file"] or sha256(path) != w["sha256"]:
            raise SystemExit(f"error: {path.name}: not the locked {w['file']} (sha256 {w['sha256'][:12]}...)")
        manifest.append({k: w[k] for k in ("name", "version", "file", "sha256", "bytes")})
    for old in dest.glob("gamma_titan-*.whl"):
        old.unlink()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dest), str(REPO)], check=True)
    project = entry(next(dest.glob("gamma_titan-*.whl")))
    manifest.append({k: project[k] for k in ("name", "version", "file", "sha256", "bytes")})
    total = sum(w["bytes"] for w in manifest)
    if total > MAX_BYTES:
        raise SystemExit(f"error: the wheels take {total / 2**20:.1f} MiB; at most {MAX_BYTES / 2**20:.0f} MiB travel")
    (dest / MANIFEST).write_text(json.dumps({"generated": date.today().isoformat(), "total_bytes": total,
                                             "wheels": manifest}, indent=1) + "\n")
    print(f"{len(manifest)} wheels, {total / 2**20:.1f} MiB, in {dest}/ (manifest: {dest / MANIFEST})")


def verify(folder: Path) -> list[str]:
    """Problems of a wheel folder against its manifest (missing, extra or altered wheels,
    the image's own torch stack); [] when it may be installed."""
    manifest_path = folder / MANIFEST
    if not manifest_path.exists():
        return [f"{manifest_path}: no manifest (make the folder with bash tools/gpu_wheels.sh)"]
    listed = {w["file"]: w for w in json.loads(manifest_path.read_text())["wheels"]}
    present = {p.name for p in folder.glob("*.whl")}
    problems = [f"{f}: in the manifest, not in {folder}" for f in sorted(set(listed) - present)]
    problems += [f"{f}: in {folder}, not in the manifest" for f in sorted(present - set(listed))]
    for f in sorted(set(listed) & present):
        if is_never_carried(listed[f]["name"]):
            problems.append(f"{f}: the image's torch stack is never replaced")
        elif sha256(folder / f) != listed[f]["sha256"]:
            problems.append(f"{f}: sha256 differs from the manifest")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("download").add_argument("dest", type=Path)
    sub.add_parser("lock")
    sub.add_parser("verify").add_argument("folder", type=Path)
    sub.add_parser("installed")
    ns = parser.parse_args(argv)
    if ns.command == "download":
        download(ns.dest)
    elif ns.command == "lock":
        LOCK.write_text(json.dumps(lock(), indent=1) + "\n")
        print(f"wrote {LOCK}")
    elif ns.command == "verify":
        problems = verify(ns.folder)
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 2 if problems else 0
    elif ns.command == "installed":
        errors, warnings = installed_problems()
        for p in warnings:
            print(f"warning: {p} (the image's own; going on)", file=sys.stderr)
        for p in errors:
            print(f"error: {p}", file=sys.stderr)
        return 2 if errors else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
