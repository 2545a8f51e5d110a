"""bench/perf_split.py: perf's per-object shares grouped the way a transport row reads them."""
from bench.perf_split import group_of, shares

REPORT = """
    41.20%  [kernel.kallsyms]
    22.00%  cygrpc.cpython-311-x86_64-linux-gnu.so
    15.50%  libc.so.6
     9.00%  libpython3.11.so.1.0
     3.00%  loop.cpython-311-x86_64-linux-gnu.so
     2.30%  _xxhash.cpython-311-x86_64-linux-gnu.so
     1.00%  libcrypto.so.3
     6.00%  [unknown]

# a comment line perf may print
"""


def test_shares_are_grouped_by_shared_object_and_sum_to_the_samples():
    got = shares(REPORT)
    want = {"kernel": 0.412, "grpc_core_http2_and_tls": 0.22, "libc_memcpy": 0.155, "python": 0.12,
            "xxhash": 0.023, "openssl_tls": 0.01, "other": 0.06}
    assert set(got) == set(want) and all(abs(got[k] - want[k]) < 1e-9 for k in want)


def test_an_unknown_object_is_other():
    assert group_of("libfoo.so") == "other" and group_of("[kernel.vmlinux]") == "kernel"
