"""vLLM worker extension: load one weight bucket (a safetensors file, e.g. in /dev/shm) into the
running model, in place. Imported inside the vLLM server's workers (`--worker-extension-cls
megatron_rl_vllm_ext.BucketLoader`, with this folder on PYTHONPATH), so it depends on nothing of
megatron-rl and runs under the vLLM virtualenv's own torch.

Called through vLLM's dev endpoint `POST /collective_rpc {"method": "megatron_rl_load_bucket",
"args": [path]}` by `rollout/weight_sync.py`'s `VLLMSharedMemoryTransport`. The tensors carry HF
names. They go through vLLM's own in-place reload (`model_runner.reload_weights` with a weights
iterator): the model's `load_weights` maps them onto its fused parameters (qkv, gate_up) and
tensor-parallel shards, and each module is re-processed into its kernel layout (the CPU backend
repacks linear weights, so writing into the parameters directly would not work). Modules that
the bucket does not cover keep their current weights; a bucket must hold all the HF tensors of
every module it touches (the sender cuts buckets between decoder layers only).

Tied embeddings: vLLM's loaders skip `lm_head.weight` when the config ties it to the embedding,
and the in-place reload then keeps the output layer's old kernel, so after a bucket with the
embedding the output layer is re-tied here (`_retie`): the new embedding copied into it when
the two no longer share storage, and its kernel rebuilt.
The disk path (`megatron_rl_reload_from_path`, vLLM's `reload_weights(weights_path=...)`) needs
the same step.
"""

from __future__ import annotations


class BucketLoader:
    """Mixed into vLLM's worker class (vLLM makes the worker inherit from it)."""

    def megatron_rl_load_bucket(self, path: str) -> dict:
        from safetensors.torch import load_file

        tensors = load_file(path, device="cpu")
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()),
                                         is_checkpoint_format=True)
        retied = self._retie() if any("embed_tokens" in k for k in tensors) else False
        return {"received": len(tensors), "retied": retied}

    def megatron_rl_reload_from_path(self, path: str) -> dict:
        self.model_runner.reload_weights(weights_path=path, is_checkpoint_format=True)
        return {"received": -1, "retied": self._retie()}

    def _retie(self) -> bool:
        import torch

        model = self.model_runner.model
        hf = self.model_runner.model_config.hf_config
        if not getattr(hf, "tie_word_embeddings", False):
            return False
        head, embed = model.lm_head.weight, model.model.embed_tokens.weight
        if head.data_ptr() != embed.data_ptr():
            with torch.no_grad():
                head.copy_(embed)
        # The output layer's kernel may hold its own packed copy of the weight (the CPU
        # backend prepacks it at load time): rebuild it from the new values.
        method = getattr(model.lm_head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(model.lm_head)
        return True
