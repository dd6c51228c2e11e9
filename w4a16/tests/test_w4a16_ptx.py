"""The NF4 codebook lookups' inline PTX, run on the CPU by a small emulator of the integer instructions they use
(mov, and, shl, shr, add, prmt, lop3, shfl.sync.idx over warps of 32 lanes: element i of a vector is lane i % 32, and
32-bit shared-memory loads and vector stores), bit for bit against a direct lookup of the codebook.

The interpreter runs the kernels' EMULATE branches instead of their PTX, so without this a GPU run would be the
first to execute the lookups. The emulator knows only these instructions: PTX using another one fails here.
"""

import importlib

import numpy as np
import pytest
import torch

MASK32 = np.uint64(0xFFFFFFFF)


def _prmt(a, b, c):
    """PTX prmt.b32 (default mode): byte i of the result is byte (c >> 4 i) & 7 of {b, a}, sign-replicated
    where bit 3 of that selector nibble is set."""
    src = np.stack([(a >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)]
                   + [(b >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)])
    out = np.zeros_like(a)
    for i in range(4):
        sel = (c >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = np.take_along_axis(src, (sel & np.uint64(7)).astype(np.int64)[None], axis=0)[0]
        replicated = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= np.where(sel & np.uint64(8), replicated, byte) << np.uint64(8 * i)
    return out


def _lop3(a, b, c, lut):
    """PTX lop3.b32: bit k of the result is bit (4 a_k + 2 b_k + c_k) of `lut` (an immediate, broadcast)."""
    out = np.zeros_like(a)
    for minterm in range(8):
        if int(lut.flat[0]) >> minterm & 1:
            term = MASK32.copy()
            for operand, bit in ((a, 4), (b, 2), (c, 1)):
                term &= operand if minterm & bit else ~operand & MASK32
            out |= term
    return out


def _shfl_idx(a, b, c, mask):
    """PTX shfl.sync.idx.b32 with c = 0x1f (one 32-lane segment) and every lane taking part: lane i reads `a` of
    lane b & 31 of its warp."""
    assert int(c.flat[0]) == 0x1F and int(mask.flat[0]) == 0xFFFFFFFF, "only whole-warp shuffles are emulated"
    lanes = np.arange(a.size)
    return a[lanes - lanes % 32 + (b & np.uint64(31)).astype(np.int64)]


OPS = {"mov.b32": lambda a: a, "mov.u32": lambda a: a, "and.b32": lambda a, b: a & b, "shr.u32": lambda a, b: a >> b,
       "shr.b32": lambda a, b: a >> b, "shl.b32": lambda a, b: a << b, "add.u32": lambda a, b: a + b,
       "prmt.b32": _prmt, "lop3.b32": _lop3, "shfl.sync.idx.b32": _shfl_idx}


class SharedMemory:
    """32-bit words of a program's shared memory, with the addresses of the last load (to check its banks)."""

    def __init__(self, size: int = 1 << 16):
        self.words = np.zeros(size // 4, dtype=np.uint64)
        self.last_load = None

    @staticmethod
    def _index(address):
        assert np.all(address % np.uint64(4) == 0), "unaligned 32-bit access"
        return (address // np.uint64(4)).astype(np.int64)

    def load(self, address):
        self.last_load = address
        return self.words[self._index(address)]

    def store(self, address, value):
        self.words[self._index(address)] = value


def _address(text: str, regs: dict, shape) -> np.ndarray:
    """A PTX address operand, ``[reg]`` or ``[reg+imm]``."""
    reg, _, offset = text.strip("[]").partition("+")
    return regs[reg] + np.uint64(int(offset, 0) if offset else 0)


def _run_ptx(text: str, registers: dict, shared: SharedMemory | None = None) -> dict:
    """Execute straight-line PTX on vectors of 32-bit values (1-D, whole warps); `registers` maps operand names to
    arrays; `shared` backs ld.shared.b32 / st.shared.v4.b32 (stores in element order: duplicates store alike)."""
    shape = np.broadcast_shapes(*(np.shape(value) for value in registers.values()))
    regs = {name: np.broadcast_to(np.asarray(value, dtype=np.uint64), shape) for name, value in registers.items()}
    regs["%laneid"] = np.arange(int(np.prod(shape)), dtype=np.uint64).reshape(shape) % np.uint64(32)
    for line in text.split("\n"):
        line = line.strip().rstrip(";")
        if line in ("", "{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op == "ld.shared.b32":
            dest, address = (arg.strip() for arg in args.split(",", 1))
            regs[dest] = shared.load(_address(address, regs, shape))
            continue
        if op == "st.shared.v4.b32":
            address, values = (arg.strip() for arg in args.split(",", 1))
            for i, name in enumerate(v.strip() for v in values.strip("{}").split(",")):
                shared.store(_address(address, regs, shape) + np.uint64(4 * i), regs[name])
            continue
        dest, *srcs = (arg.strip() for arg in args.split(","))
        if op not in OPS:
            raise AssertionError(f"the emulator does not know {op!r}: teach it before trusting this PTX")
        values = [regs[s] if s in regs else np.full(shape, int(s, 0), dtype=np.uint64) for s in srcs]
        regs[dest] = OPS[op](*values) & MASK32
    return regs


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("w4a16")


@pytest.fixture(scope="module")
def codebook_bits():
    """fp16 bits of a random sorted codebook / 16 (the GEMV's tables) and the 8 PRMT tables of them: low bytes
    of entries 0-3, 4-7, 8-11, 12-15, then high bytes."""
    gen = torch.Generator().manual_seed(0)
    codebook = torch.sort(torch.rand(16, generator=gen) * 2 - 1).values
    bits = (codebook / 16).half().view(torch.int16).numpy().astype(np.uint64) & np.uint64(0xFFFF)
    tables = [sum(int(bits[4 * q + e] >> np.uint64(8 * high) & np.uint64(0xFF)) << 8 * e for e in range(4))
              for high in (0, 1) for q in range(4)]
    return bits, tables


def _words(n=4096, seed=1):
    return np.random.default_rng(seed).integers(0, 2**32, size=n, dtype=np.uint64)


def _nibble(words, j):
    return ((words >> np.uint64(4 * j)) & np.uint64(0xF)).astype(np.int64)


def test_gemv_lookup_gives_both_bytes_of_each_value(k, codebook_bits):
    """`nf4_lookup_asm`: the low and high bytes of the 4 values of the selector's low nibbles."""
    bits, tables = codebook_bits
    words = _words()
    regs = _run_ptx(k.triton_kernels.nf4.nf4_lookup_asm("W", 3),
                    {"W": words, **{f"${3 + i}": np.uint64(t) for i, t in enumerate(tables)}})
    for i in range(4):
        value = bits[_nibble(words, i)]
        assert np.array_equal((regs["lo"] >> np.uint64(8 * i)) & np.uint64(0xFF), value & np.uint64(0xFF))
        assert np.array_equal((regs["hi"] >> np.uint64(8 * i)) & np.uint64(0xFF), value >> np.uint64(8))


def test_dot_pairs_hold_nibbles_j_and_j_plus_4(k, codebook_bits):
    """`_NF4_PAIRS_ASM`: pair J holds codebook[nibble J] (low half) and codebook[nibble J + 4] (high half)."""
    bits, tables = codebook_bits
    words = _words(seed=2)
    text = k.triton_kernels.nf4._NF4_PAIRS_ASM
    regs = _run_ptx(getattr(text, "value", text),
                    {"$4": words, **{f"${5 + i}": np.uint64(t) for i, t in enumerate(tables)}})
    for j in range(4):
        assert np.array_equal(regs[f"${j}"], bits[_nibble(words, j)] | bits[_nibble(words, j + 4)] << np.uint64(16))


def test_mma_planes_pair_the_same_nibble_of_neighbouring_words(k, codebook_bits):
    """The mma kernel's `_nf4_planes_asm`: output j pairs codebook[nibble j of a] (low half) with
    codebook[nibble j of b]; each table's second operand (pack 2 gives each element its own) is never read."""
    mma = pytest.importorskip(f"{k.__name__}.triton_kernels.mma", reason="this Triton has no Gluon")
    bits, tables = codebook_bits
    a, b = _words(seed=3), _words(seed=4)
    operands = {"$8": a, "$9": b}
    for i, t in enumerate(tables):
        operands[f"${10 + 2 * i}"] = np.uint64(t)
        operands[f"${11 + 2 * i}"] = np.uint64(0xDEADBEEF)
    regs = _run_ptx(mma._nf4_planes_asm()[0], operands)
    for j in range(8):
        assert np.array_equal(regs[f"${j}"], bits[_nibble(a, j)] | bits[_nibble(b, j)] << np.uint64(16))


def test_emulator_catches_a_wrong_selector(k, codebook_bits):
    """The check can fail: the mma lookup with its half selectors' 0x3210 base dropped gives other values."""
    mma = pytest.importorskip(f"{k.__name__}.triton_kernels.mma", reason="this Triton has no Gluon")
    bits, tables = codebook_bits
    a, b = _words(seed=5), _words(seed=6)
    operands = {"$8": a, "$9": b, **{f"${10 + 2 * i}": np.uint64(t) for i, t in enumerate(tables)}}
    regs = _run_ptx(mma._nf4_planes_asm()[0].replace("0x32103210", "0x0"), operands)
    assert not np.array_equal(regs["$0"], bits[_nibble(a, 0)] | bits[_nibble(b, 0)] << np.uint64(16))


def _lane_table(k, tables, n):
    """`NF4_LANE_ASM` run on n lanes: each lane's entry of the codebook in the tables."""
    text = k.triton_kernels.nf4.NF4_LANE_ASM
    return _run_ptx(getattr(text, "value", text),
                    {"$9": np.zeros(n, dtype=np.uint64), **{f"${1 + i}": np.uint64(t) for i, t in enumerate(tables)}})["$0"]


def test_lane_table_holds_the_codebook_entry_of_lane_mod_16(k, codebook_bits):
    bits, tables = codebook_bits
    lane = _lane_table(k, tables, 64)
    assert np.array_equal(lane & np.uint64(0xFFFF), bits[np.arange(64) % 16])


def test_gemv_shuffle_pairs_hold_neighbouring_nibbles(k, codebook_bits):
    """`nf4_shfl_pair_asm` as the GEMV uses it: the pair (codebook[nibble j], codebook[nibble j + 1]) of each
    lane's own word, though every shuffle reads another lane's table entry."""
    bits, tables = codebook_bits
    words = _words(seed=7)
    lane = _lane_table(k, tables, words.size)
    for j in (0, 2, 4, 6):
        text = k.triton_kernels.nf4.nf4_shfl_pair_asm("W", j, "W", j + 1, "out", "T")
        regs = _run_ptx(text, {"W": words, "T": lane})
        assert np.array_equal(regs["out"], bits[_nibble(words, j)] | bits[_nibble(words, j + 1)] << np.uint64(16))


@pytest.mark.parametrize("shuffled", [1, 2])
def test_mma_shuffle_planes_pair_the_same_nibble_of_neighbouring_words(k, codebook_bits, shuffled):
    """The mma kernel's `_nf4_planes_asm` with one or both halves looked up by shuffles: output j pairs
    codebook[nibble j of a] with codebook[nibble j of b], as the PRMT lookup does; each second operand (pack 2) is
    never read."""
    mma = pytest.importorskip(f"{k.__name__}.triton_kernels.mma", reason="this Triton has no Gluon")
    bits, tables = codebook_bits
    a, b = _words(seed=8), _words(seed=9)
    operands, n = {"$8": a, "$9": b}, 10
    if shuffled < 2:
        for i, t in enumerate(tables):
            operands[f"${n + 2 * i}"], operands[f"${n + 2 * i + 1}"] = np.uint64(t), np.uint64(0xDEADBEEF)
        n += 16
    operands[f"${n}"], operands[f"${n + 1}"] = _lane_table(k, tables, a.size), np.uint64(0xDEADBEEF)
    regs = _run_ptx(mma._nf4_planes_asm(shuffled)[0], operands)
    for j in range(8):
        assert np.array_equal(regs[f"${j}"], bits[_nibble(a, j)] | bits[_nibble(b, j)] << np.uint64(16))


def test_emulated_shuffle_reads_other_lanes(k, codebook_bits):
    """The check can fail: without the lane table (every lane's own entry in its register instead of
    codebook[lane % 16]) the shuffles return other values."""
    bits, tables = codebook_bits
    words = _words(seed=10)
    text = k.triton_kernels.nf4.nf4_shfl_pair_asm("W", 0, "W", 1, "out", "T")
    regs = _run_ptx(text, {"W": words, "T": bits[_nibble(words, 0)]})
    assert not np.array_equal(regs["out"], bits[_nibble(words, 0)] | bits[_nibble(words, 1)] << np.uint64(16))


def _pair_table(k, tables, base, half=False):
    """Shared memory after `_NF4_FILL_ASM` ran for its 2048 elements (with `half`, `_NF4_HALF_FILL_ASM` for 1024),
    as `nf4._nf4_pair_table` runs it: each warp's vector stores cover 512 contiguous bytes."""
    quarter = np.arange(1024 if half else 2048, dtype=np.uint64)
    shared = SharedMemory()
    text = k.triton_kernels.nf4._NF4_HALF_FILL_ASM if half else k.triton_kernels.nf4._NF4_FILL_ASM
    _run_ptx(getattr(text, "value", text), {"$1": quarter, "$2": np.uint64(base) + quarter * np.uint64(16),
                                             **{f"${3 + i}": np.uint64(t) for i, t in enumerate(tables)}}, shared)
    return shared


@pytest.mark.parametrize("byte", range(4))
def test_pair_table_gives_the_pair_of_each_byte_from_the_lanes_own_bank(k, codebook_bits, byte):
    """`nf4_pair_table_asm` on a filled table: byte i of a word reads (codebook[nibble 2i], codebook[nibble
    2i + 1]), and lane l always from bank l (a warp's lookups never conflict)."""
    bits, tables = codebook_bits
    base = 0x400
    shared = _pair_table(k, tables, base)
    words = _words(seed=11)
    lane = np.arange(words.size, dtype=np.uint64) % np.uint64(32)
    regs = _run_ptx(k.triton_kernels.nf4.nf4_pair_table_asm("W", byte, "L", "B", "out"),
                    {"W": words, "L": lane * np.uint64(4), "B": np.uint64(base)}, shared)
    assert np.array_equal(regs["out"], bits[_nibble(words, 2 * byte)] | bits[_nibble(words, 2 * byte + 1)] << np.uint64(16))
    assert np.array_equal(shared.last_load // np.uint64(4) % np.uint64(32), lane)


def test_pair_table_lookup_needs_the_lane_column(k, codebook_bits):
    """The check can fail: a table filled only in lane 0's column reads zeros elsewhere."""
    bits, tables = codebook_bits
    shared = _pair_table(k, tables, 0x400)
    shared.words[0x100:0x100 + 8192][np.arange(8192) % 32 != 0] = 0
    words = _words(seed=12)
    lane = np.arange(words.size, dtype=np.uint64) % np.uint64(32)
    regs = _run_ptx(k.triton_kernels.nf4.nf4_pair_table_asm("W", 1, "L", "B", "out"),
                    {"W": words, "L": lane * np.uint64(4), "B": np.uint64(0x400)}, shared)
    assert not np.array_equal(regs["out"], bits[_nibble(words, 2)] | bits[_nibble(words, 3)] << np.uint64(16))


def test_mma_table_planes_pair_the_same_nibble_of_neighbouring_words(k, codebook_bits):
    """The mma kernel's `_nf4_table_planes_asm` on a filled table: output j pairs codebook[nibble j of a] with
    codebook[nibble j of b], as its PRMT lookup does; each second operand (pack 2) is never read."""
    mma = pytest.importorskip(f"{k.__name__}.triton_kernels.mma", reason="this Triton has no Gluon")
    bits, tables = codebook_bits
    shared = _pair_table(k, tables, 0x400)
    a, b = _words(seed=13), _words(seed=14)
    lane = np.arange(a.size, dtype=np.uint64) % np.uint64(32)
    regs = _run_ptx(mma._nf4_table_planes_asm(), {"$8": a, "$9": b, "$10": lane * np.uint64(4),
                                                   "$11": np.uint64(0xDEADBEEF), "$12": np.uint64(0x400),
                                                   "$13": np.uint64(0xDEADBEEF)}, shared)
    for j in range(8):
        assert np.array_equal(regs[f"${j}"], bits[_nibble(a, j)] | bits[_nibble(b, j)] << np.uint64(16))


@pytest.mark.parametrize("byte", range(4))
def test_wgmma_table_pairs_hold_chunks_j_and_j_plus_1(k, codebook_bits, byte):
    """The wgmma kernel's lookup in the pair table (`_nf4_chunk_pairs_ptx` with `smem`, its lane and the table's
    address read in the PTX): for chunk j = 2 byte, p pairs codebook[nibble j of a] with codebook[nibble j of b],
    q the same for nibble j + 1, as its PRMT lookup pairs them."""
    wgmma = pytest.importorskip(f"{k.__name__}.triton_kernels.wgmma", reason="this Triton has no Gluon Hopper ops")
    bits, tables = codebook_bits
    shared = _pair_table(k, tables, 0x400)
    a, b = _words(seed=16), _words(seed=17)
    text = "\n".join(wgmma._nf4_chunk_pairs_ptx(byte, True))
    regs = _run_ptx(text, {"$2": a, "$3": b, "nf4_pair_table": np.uint64(0x400)}, shared)
    for out, j in (("p", 2 * byte), ("q", 2 * byte + 1)):
        assert np.array_equal(regs[out], bits[_nibble(a, j)] | bits[_nibble(b, j)] << np.uint64(16))


def test_dot_table_pairs_hold_nibbles_j_and_j_plus_4(k, codebook_bits):
    """`_NF4_TABLE_PAIRS_ASM` (the dot path's lookup in the pair table, its lane and base read in the PTX): pair J
    holds codebook[nibble J] (low half) and codebook[nibble J + 4] (high half), as `_NF4_PAIRS_ASM`'s do."""
    bits, tables = codebook_bits
    shared = _pair_table(k, tables, 0x400)
    words = _words(seed=15)
    text = k.triton_kernels.nf4._NF4_TABLE_PAIRS_ASM
    regs = _run_ptx(getattr(text, "value", text), {"$4": words, "nf4_pair_table": np.uint64(0x400)}, shared)
    for j in range(4):
        assert np.array_equal(regs[f"${j}"], bits[_nibble(words, j)] | bits[_nibble(words, j + 4)] << np.uint64(16))


def test_half_table_gives_the_same_pairs_at_most_two_lanes_a_bank(k, codebook_bits):
    """The half table (E75: 16 copies of each entry, lane l reading copy l % 16) and the dot path's lookup in it
    (`_NF4_HALF_TABLE_PAIRS_ASM`) give `_NF4_PAIRS_ASM`'s pairs; within a warp at most two lanes (l, l + 16) read
    different words of one bank. The table's entries stop at 16 KB."""
    bits, tables = codebook_bits
    shared = _pair_table(k, tables, 0x400, half=True)
    assert not shared.words[(0x400 + 16384) // 4:].any()
    words = _words(seed=18)
    text = k.triton_kernels.nf4._NF4_HALF_TABLE_PAIRS_ASM
    regs = _run_ptx(getattr(text, "value", text), {"$4": words, "nf4_pair_table_16": np.uint64(0x400)}, shared)
    for j in range(4):
        assert np.array_equal(regs[f"${j}"], bits[_nibble(words, j)] | bits[_nibble(words, j + 4)] << np.uint64(16))
    words_read = (shared.last_load // np.uint64(4)).reshape(-1, 32)
    for warp in words_read:
        per_bank = {}
        for word in warp:
            per_bank.setdefault(int(word) % 32, set()).add(int(word))
        assert max(len(found) for found in per_bank.values()) <= 2
