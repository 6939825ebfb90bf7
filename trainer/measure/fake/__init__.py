"""What a step on fake tensors needs that torch does not give: a compiled step run on fakes (`compiled`), fake rules
for CPU kernels torch's meta kernels get wrong (`kernels`), attention as a CUDA GPU runs it for an estimate translated
from the CPU (`cuda_attention`), torch's fake process group behind one import (`process_group`)."""
