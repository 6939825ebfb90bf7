"""What every figure comes from, by question.

    memory/   how many bytes: `tracker` the live-tensor tracker (a dispatch mode, eager steps, real or fake tensors),
              `allocator_events` what the allocator hands out (torch.profiler's memory events: compiled steps),
              `caching_allocator` what CUDA's caching allocator would reserve for those events (a model of it)
    time/     how long: `flops` FLOP formulas torch lacks, `op_trace` each op's kind, FLOPs and bytes, `roofline` a
              trace's time at a device's speed, `calibration` this CPU's speed (and a catalogue GPU's), `op_replay`
              an op rebuilt on real tensors to time it, `collectives` FSDP2's traffic on the GPU link
    fake/     what the estimator's fake tensors need that torch lacks: `compiled` a compiled step on fakes (inductor's
              code run with its kernels as stand-ins), `kernels` fake rules for CPU kernels, `process_group` torch's
              fake process group, imported in this one place
    gpus      the GPU catalogue (conf/gpu/) and the memory reserve
    metrics   every metric tag and summary key, and how a run's steps reduce to its figures

memory/ and time/ import nothing of each other; fake/ uses both (the import contracts in pyproject.toml say so). The
measuring library knows no policy, model, planner, estimator, run or callback.
"""
