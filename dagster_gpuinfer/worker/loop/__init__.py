"""The loop: the vLLM engine of one replica (`engine`, with `cpu_dtype` and `cpu_seeds` for
vLLM's CPU build), and the engine loop that keeps a window of requests in flight across
chunks, prepares ahead, renders image prompts and writes behind (`engine_loop`), each chunk's
share of the engine's time (`engine_time`).
"""
