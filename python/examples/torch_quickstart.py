"""kvattn from PyTorch in 20 lines: wrap the engine's KV pool and req_to_token, one EXTEND step of
a 100-token prompt, one layer's attention. Runs on the GPU when kvattn has CUDA, else the CPU."""
import torch, kvattn

dev = "cuda" if torch.cuda.is_available() and kvattn.cuda_compiled() else "cpu"
k_pool = torch.zeros(4096, 8, 128, dtype=torch.bfloat16, device=dev)  # the engine's KV pool and
v_pool, table = torch.zeros_like(k_pool), torch.zeros(8, 2048, dtype=torch.int32, device=dev)
cache = kvattn.KvCache.wrap(kvattn.KvCacheConfig(num_slots=4096, num_kv_heads=8, head_dim=128,
                            page_size=16, dtype=torch.bfloat16, device=dev), [k_pool], [v_pool])
pool = kvattn.ReqToTokenPool.wrap(table)                  # req_to_token: wrapped, never copied
backend = kvattn.make_backend(dev, kvattn.BackendConfig(kv_cache=cache, req_to_token_pool=pool,
    num_q_heads=32, num_kv_heads=8, head_dim=128, q_dtype=torch.bfloat16))
table[0, :100] = torch.arange(16, 116)                    # a 100-token prompt in slots 16..115
lens = lambda n: torch.tensor([n], dtype=torch.int32, device=dev)
batch = kvattn.ForwardBatch("EXTEND", 1, req_pool_indices=lens(0), seq_lens=lens(100),
    seq_lens_cpu=[100], extend_prefix_lens=lens(0), extend_prefix_lens_cpu=[0],
    extend_seq_lens=lens(100), extend_seq_lens_cpu=[100], out_cache_loc=table[0, :100],
    req_to_token_pool=pool, kv_cache=cache)
backend.init_forward_metadata(batch)                      # once per step
q, k, v = (torch.randn(100, h, 128, dtype=torch.bfloat16, device=dev) for h in (32, 8, 8))
layer = kvattn.AttentionLayer(num_q_heads=32, num_kv_heads=8, head_dim=128, scaling=128**-0.5)
out = backend.forward(q, k, v, layer, batch)              # [100, 32 * 128]; K/V saved in k_pool/v_pool
print(out.shape, dev, torch.equal(k_pool[16:116], k))
