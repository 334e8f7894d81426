"""The torch this package was built for, and the check that it is the torch being imported.

morph._torch_backend subclasses c10d's Backend, Work and Store in C++ against one torch's
headers: their class layouts, virtual methods and exported symbols change between torch minor
releases, so under another major.minor the extension fails to load (an undefined symbol) or,
worse, loads and calls the wrong virtual method. `import morph` therefore refuses, naming both
versions, unless torch's major.minor is the one recorded at build time (_torch_build.py, written
by python/CMakeLists.txt; a package built without torch has none and checks nothing).
Patch releases and local tags (+cpu, +cu132) do not matter. docs/torch.md "Building".
"""
from __future__ import annotations

import re
from typing import Optional


def major_minor(version: str) -> str:
    """'2.15.0+cu132' -> '2.15'; ValueError for what is not a torch version."""
    m = re.match(r"(\d+)\.(\d+)(?:\D|$)", str(version))
    if m is None:
        raise ValueError(f"not a torch version: {version!r}")
    return f"{m.group(1)}.{m.group(2)}"


def check(built: Optional[str], running: str, where: str = "") -> None:
    """Raises ImportError unless `running` has the major.minor of `built` (None: no torch
    backend was built, nothing to check)."""
    if built is None or major_minor(built) == major_minor(running):
        return
    b, r = major_minor(built), major_minor(running)
    raise ImportError(
        f"morph was built against torch {built} but this process imports torch {running}"
        f"{' from ' + where if where else ''}: morph._torch_backend (a c10d Backend and Store "
        f"compiled against torch's C++ headers) runs only under the torch {b}.* it was built "
        f"for. Rebuild morph against torch {r} (MORPH_TORCH={r}; docs/torch.md \"Building\") "
        f"or run it under torch {b}.*")


def check_imported_torch() -> None:
    """`import morph`'s check: the recorded build version against the torch imported here."""
    try:
        from ._torch_build import TORCH_VERSION as built
    except ImportError:
        return  # built without torch: no morph._torch_backend to protect
    import torch

    check(built, torch.__version__, getattr(torch, "__file__", "") or "")
