"""Tessera's KV connector for vLLM on hosts without GPU-to-GPU transfer: vLLM's example connector (each
prompt's KV written under a shared folder, keyed by its tokens, and read by the decode engine), made safe to
crash and to share.

This file is loaded by vLLM inside its own processes (``kv_connector_module_path``: ``tessera_kv_store``, with
this folder on ``PYTHONPATH``); Tessera never imports it. The example connector has two hazards Tessera's
deployments hit: a prefill engine killed while it writes a prompt's layers leaves a folder the decode engine
takes for a whole one (it then fails loading the missing layers, and its engine core dies), and two prompts
with the same leading blocks rewrite one folder while the decode engine may be reading it. Here a folder
counts only once a ``.complete`` marker is written after every layer of its prompt was saved, and a complete
folder is never written again (the same tokens give the same KV).
"""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    align_to_block_size,
)

MARKER = ".complete"


class TesseraStoreConnector(ExampleConnector):
    """The example connector with complete-folder markers (see the module docstring)."""

    def _folder(self, token_ids, mm_hashes) -> str:
        return self._generate_foldername_debug(token_ids, mm_hashes, create_folder=False)

    def _complete(self, folder: str) -> bool:
        return os.path.exists(os.path.join(folder, MARKER))

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        every = meta.requests
        meta.requests = [r for r in every if not (r.is_store and self._complete(self._folder(r.token_ids,
                                                                                               r.mm_hashes)))]
        try:
            super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        finally:
            meta.requests = every

    def wait_for_save(self) -> None:
        super().wait_for_save()
        meta = self._get_connector_metadata()
        for r in meta.requests:
            if r.is_store and len(r.token_ids):
                folder = self._folder(r.token_ids, r.mm_hashes)
                if os.path.isdir(folder) and not self._complete(folder):
                    tmp = os.path.join(folder, f"{MARKER}.{os.getpid()}")
                    with open(tmp, "w") as f:
                        f.write("complete\n")
                    os.replace(tmp, os.path.join(folder, MARKER))

    def _found_match_for_prompt(self, prompt_token_ids: list[int], mm_hashes: list[str]) -> bool:
        import torch

        n = align_to_block_size(len(prompt_token_ids) - 1, self._block_size)
        if n <= 0:
            return False
        return self._complete(self._folder(torch.tensor(prompt_token_ids)[:n], mm_hashes))
