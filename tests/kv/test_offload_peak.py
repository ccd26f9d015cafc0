"""Offloaded full KV (``offload="stream"``) reports the device K/V it really holds while a layer attends.

Its device copies live only inside a forward (each layer's K/V copied in, attended, dropped; on CUDA the next
layer's prefetch beside it), so reading the device bytes after the forward found ~0 (issue 47). The cache takes
the peak over the layers of what attention read plus what was prefetched.
"""

import torch

from zoomr.kvstore.cache import PolicyKVCache
from zoomr.kvstore.full import FullPolicy

L, H, HKV, D = 3, 4, 2, 8
FP32 = 4


def run(offload: str, prompt: int = 20, steps: int = 10):
    g = torch.Generator().manual_seed(0)
    cache = PolicyKVCache(FullPolicy(), L, H, HKV, D, torch.device("cpu"), torch.float32, offload=offload)
    for T in [prompt] + [1] * steps:
        for layer in range(L):
            cache.update(layer, torch.randn(H, T, D, generator=g), torch.randn(HKV, T, D, generator=g),
                         torch.randn(HKV, T, D, generator=g))
        cache.end_forward([0] * T, "")
    return cache.stats()


def test_streamed_full_kv_reports_one_layer_of_every_position_on_the_device():
    s = run("stream")
    one_layer = 2 * HKV * s.full_tokens * D * FP32      # K and V of the last step's layer: all 30 positions
    assert s.device_kv_bytes == one_layer
    # all of it is also in host memory (the store), where the offloaded cache keeps it between steps
    assert s.host_kv_bytes >= s.full_bytes == L * one_layer


def test_resident_full_kv_reports_every_layer_on_the_device():
    s = run("resident")
    assert s.device_kv_bytes >= s.full_bytes > run("stream").device_kv_bytes
