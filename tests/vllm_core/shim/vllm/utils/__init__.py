from vllm.unmapped import module_getattr

__getattr__ = module_getattr(__name__)
