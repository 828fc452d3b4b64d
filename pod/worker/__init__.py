"""A step's plan to tensors, the model run and the samples: the runner, CUDA graphs, a draft
model's pass, and the start-up measurements of the CPU paths."""
