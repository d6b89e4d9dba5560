"""The executor on a CUDA GPU: a lean Llama forward of native kernels
(lean_forward.py) and its decode steps captured into CUDA graphs (graphs.py).
The CPU path never imports this package."""
