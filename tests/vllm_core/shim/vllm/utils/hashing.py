"""vLLM's hash functions: kvpool's copies of them (scheduler/core/vllm_hashing.py)."""

from scheduler.core.vllm_hashing import vllm_hash_function
from vllm.unmapped import module_getattr

__getattr__ = module_getattr(__name__)


def sha256(obj) -> bytes:
    return SHA256(obj)


def sha256_cbor(obj) -> bytes:
    return SHA256_CBOR(obj)


def xxhash(obj) -> bytes:
    return vllm_hash_function("xxhash")(obj)


def xxhash_cbor(obj) -> bytes:
    return vllm_hash_function("xxhash_cbor")(obj)


SHA256 = vllm_hash_function("sha256")
SHA256_CBOR = vllm_hash_function("sha256_cbor")
# The kvpool name of each function, which kvpool's hashers take.
ALGO = {sha256: "sha256", sha256_cbor: "sha256_cbor", xxhash: "xxhash", xxhash_cbor: "xxhash_cbor"}
