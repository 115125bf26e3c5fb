"""The served model: its name and limits, the ``/v1/models`` list, and the check of a
request's ``model`` field (every endpoint runs it before anything else)."""

from __future__ import annotations

import time

from .protocol import APIError


class ServedModel:
    """The one model the server serves, under ``name``; ``root`` is where it was loaded
    from (the name when unknown)."""

    def __init__(self, name: str, root: str | None, max_model_len: int):
        self.name = name
        self.root = root or name
        self.max_model_len = int(max_model_len)
        self.created = int(time.time())

    def check(self, model: str | None) -> None:
        """A request may leave ``model`` out; naming another model is a 404."""
        if model is not None and model != self.name:
            raise APIError(404, f"The model `{model}` does not exist.", "model",
                           code="model_not_found")

    def model_list(self) -> dict:
        """The body of ``GET /v1/models``."""
        return {"object": "list", "data": [{
            "id": self.name, "object": "model", "created": self.created,
            "owned_by": "eagle_jax", "root": self.root,
            "parent": None, "max_model_len": self.max_model_len, "permission": [],
        }]}
