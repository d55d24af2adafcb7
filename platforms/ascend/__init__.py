"""Ascend 950 platform through torch_npu. Never imports torch_npu at module import."""
