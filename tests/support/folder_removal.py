"""Test support: removing a folder that a server is still writing into (the soaks' "removed" chaos case)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def remove_folder_under_writer(folder: Path) -> None:
    """Remove ``folder`` while a server keeps writing files into it.

    ``shutil.rmtree`` alone races with the writer: a file the recorder creates between rmtree's listing and its
    final ``rmdir`` leaves the folder in place ("Directory not empty"), the recorder goes on writing, and the
    chaos case tests nothing (seen once in a fresh-clone rehearsal under load). A rename is atomic: from it on,
    every path under ``folder`` is gone for the writer; the renamed folder, whose name no writer knows, is then
    deleted at leisure.
    """
    gone = folder.with_name(f"{folder.name}.removed-by-test")
    os.rename(folder, gone)
    shutil.rmtree(gone)
