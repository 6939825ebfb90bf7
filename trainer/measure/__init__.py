"""What every figure comes from: live-tensor memory (`memory`), FLOPs (`flops`), the step-time model (`steptime`),
fake-tensor kernel rules for the estimator (`fake_kernels`), metric tags and summary keys (`metrics`, the only
place they are spelled) and the GPU catalogue (`gpus`)."""
