"""Where the evidence tools' data lives: the ``oea_lab_data`` package (distribution ``oea-lab-data``, built from
``packages/oea-lab-data`` and required by ``pip install 'oea[lab]'``).

``pip install oea`` ships no model or trace files (docs/architecture.md, "The lean package"): the embedded model
(``embedded/``) and the bundled traces (``traces/``) come with the lab extra. Asking for them without it raises one
``ModuleNotFoundError`` that says what to install; the ``oea`` CLI prints it as one line and exits 2.
"""

from __future__ import annotations

import importlib.resources
import pathlib

LAB_DATA_MODULE = "oea_lab_data"
# What to install for the evidence tools, their data included; oea.cli's guard prints it after any lab module's
# ModuleNotFoundError (and strips it from this module's own, so that its one line names it once).
LAB_INSTALL = "pip install 'oea[lab]'"
MISSING_LAB_DATA = f"No module named {LAB_DATA_MODULE!r}, which holds the embedded model and the bundled traces"


def lab_data_dir(folder: str) -> pathlib.Path:
    """``folder`` (``"embedded"`` or ``"traces"``) of the installed ``oea_lab_data`` package, as a directory.

    Raises ``ModuleNotFoundError`` (``name="oea_lab_data"``, naming ``LAB_INSTALL``) when the package is not
    installed, and ``FileNotFoundError`` naming the path when it is installed without ``folder`` or not as files.
    """
    try:
        # An import statement, not importlib.resources.files("oea_lab_data"): the import is then made by this
        # module, which is how tests/unit/test_lean_package.py's blocker sees oea's own code ask for lab modules.
        import oea_lab_data
    except ModuleNotFoundError as err:
        if err.name != LAB_DATA_MODULE:
            raise
        raise ModuleNotFoundError(f"{MISSING_LAB_DATA}: {LAB_INSTALL}", name=LAB_DATA_MODULE) from None
    root = importlib.resources.files(oea_lab_data)
    path = pathlib.Path(str(root)) / folder
    # Tools hand these folders to transformers and engine servers, which need real files (not a zip's members).
    if not isinstance(root, pathlib.Path) or not path.is_dir():
        raise FileNotFoundError(
            f"the oea-lab-data package has no folder {path}: reinstall it "
            f"(pip install --force-reinstall --no-deps oea-lab-data)"
        )
    return path
