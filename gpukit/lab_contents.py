"""The contents manager `gpukit lab` gives JupyterLab's server (gpukit/jupyter.py says why): notebooks open with the
metadata their kernel will report, are saved with the metadata their file had, and leave git's stat cache honest.

Imported by the Jupyter server only (it needs jupyter_server, from the lab extra): `import gpukit` never loads it.
"""

from __future__ import annotations

from jupyter_client.kernelspec import NoSuchKernel
from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

from .jupyter import as_the_kernel_reports, forget_git_stat, keep_file_metadata, python_language_info


class LessonContentsManager(AsyncLargeFileManager):
    """JupyterLab's own file manager, plus gpukit's hooks on opening and saving a notebook."""

    def __init__(self, **options):
        super().__init__(**options)
        self.register_pre_save_hook(keep_file_metadata)
        self.register_post_save_hook(forget_git_stat)
        self._language_info = None

    async def get(self, path, content=True, type=None, format=None, **options):
        model = await super().get(path, content=content, type=type, format=format, **options)
        if model.get("type") == "notebook" and model.get("content"):
            metadata = model["content"]["metadata"]
            if self._language_info is None:
                self._language_info = python_language_info()
            as_the_kernel_reports(metadata, self._kernel_spec(metadata), self._language_info)
        return model

    def _kernel_spec(self, metadata: dict) -> dict | None:
        """The installed spec of the kernel the notebook names ({"display_name", "language", …}), or None."""
        name = (metadata.get("kernelspec") or {}).get("name")
        specs = getattr(self.parent, "kernel_spec_manager", None)
        if not name or specs is None:
            return None
        try:
            return specs.get_kernel_spec(name).to_dict()
        except NoSuchKernel:
            return None
