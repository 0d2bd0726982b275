"""KV memory: the torch-free page allocator (``page_allocator``), the KV cache formats
(``kv_formats``, torch-free), and the per-layer K/V page pools (``kv_pool``)."""
