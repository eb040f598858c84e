"""KaTeX for the offline site: the npm package's ``dist/``, fetched once and pinned.

The site renders math in the browser with KaTeX served from the site itself
(``assets/katex/``): no CDN, no web font service. The files come from the
``katex`` package of the npm registry, fetched with ``npm pack`` (npm ships
with Node.js) and checked against the pinned integrity hash below, then kept
in a cache so that later builds need no network at all:

* ``$NORMSPEC_KATEX_TGZ``: use this tarball (e.g. one you carried to an
  air-gapped machine); its integrity is checked all the same;
* otherwise ``$XDG_CACHE_HOME/normspec-docs/katex-<version>.tgz``
  (``~/.cache/...``), filled by ``npm pack katex@<version>`` on first use.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

__all__ = ["KATEX_INTEGRITY", "KATEX_VERSION", "katex_assets", "katex_tarball"]

KATEX_VERSION = "0.19.1"
#: ``npm view katex@0.19.1 dist.integrity``
KATEX_INTEGRITY = (
    "sha512-jG8uKntjSEcm2EpQOh0XturpPuuC9r3Sq5HLHdsFdWZT27E672SF19QEi+of0/YeOy15lDgRhKvr5614uRrEfA=="
)
#: Files of the package's ``dist/`` the site needs (plus every font).
_DIST_FILES = ("katex.min.js", "katex.min.css")


class KatexUnavailableError(RuntimeError):
    """KaTeX could not be found in the cache nor fetched with npm."""


def _integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def _cache_path() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "normspec-docs" / f"katex-{KATEX_VERSION}.tgz"


def _checked(path: Path) -> Path:
    got = _integrity(path.read_bytes())
    if got != KATEX_INTEGRITY:
        raise KatexUnavailableError(
            f"KaTeX tarball {path}: integrity {got} does not match katex@{KATEX_VERSION}'s "
            f"{KATEX_INTEGRITY}; delete it (or fix $NORMSPEC_KATEX_TGZ) and build again"
        )
    return path


def _npm_pack(dest: Path) -> Path:
    npm = shutil.which("npm")
    if npm is None:
        raise KatexUnavailableError(
            f"KaTeX {KATEX_VERSION} is not cached at {dest} and npm is not installed: install "
            "Node.js/npm (Debian: apt-get install -y npm), or point $NORMSPEC_KATEX_TGZ at "
            f"katex-{KATEX_VERSION}.tgz (npm pack katex@{KATEX_VERSION})"
        )
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [npm, "pack", f"katex@{KATEX_VERSION}", "--json", "--pack-destination", tmp],
            cwd=tmp, capture_output=True, text=True, timeout=300, check=False,
        )
        if proc.returncode != 0:
            raise KatexUnavailableError(
                f"npm pack katex@{KATEX_VERSION} failed ({proc.returncode}): "
                f"{proc.stderr.strip()[-2000:]}"
            )
        (info,) = json.loads(proc.stdout)
        tgz = Path(tmp) / info["filename"]
        _checked(tgz)
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_suffix(".partial")
        shutil.copyfile(tgz, partial)
        partial.replace(dest)
    return dest


def katex_tarball() -> Path:
    """The checked ``katex-<version>.tgz``: from ``$NORMSPEC_KATEX_TGZ``, the cache or npm."""
    override = os.environ.get("NORMSPEC_KATEX_TGZ")
    if override:
        path = Path(override)
        if not path.is_file():
            raise KatexUnavailableError(f"$NORMSPEC_KATEX_TGZ: no such file {path}")
        return _checked(path)
    cached = _cache_path()
    if cached.is_file():
        return _checked(cached)
    return _npm_pack(cached)


def katex_assets() -> dict[str, bytes]:
    """Site files for ``assets/katex/``: the minified JS and CSS, the fonts, the licence."""
    wanted = {f"package/dist/{name}": name for name in _DIST_FILES}
    wanted["package/LICENSE"] = "LICENSE"
    out: dict[str, bytes] = {}
    with tarfile.open(katex_tarball(), "r:gz") as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            if member.name in wanted:
                name = wanted[member.name]
            elif member.name.startswith("package/dist/fonts/"):
                name = "fonts/" + member.name.rsplit("/", 1)[1]
            else:
                continue
            data = tar.extractfile(member)
            assert data is not None
            out[name] = data.read()
    missing = [n for n in [*_DIST_FILES, "LICENSE"] if n not in out]
    if missing or not any(n.startswith("fonts/") for n in out):
        raise KatexUnavailableError(f"katex@{KATEX_VERSION} tarball lacks {missing or 'fonts'}")
    return out
