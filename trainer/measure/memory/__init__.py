"""How many bytes a step holds: the live-tensor tracker (`tracker`), the allocator's own reports (`allocator_events`)
and a model of CUDA's caching allocator that replays either of them (`caching_allocator`)."""
