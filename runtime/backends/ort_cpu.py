"""The ort-cpu backend: ONNX Runtime's CPU execution provider, with IO binding, and the
session every ONNX Runtime backend opens (checked against the bundle's contract)."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from specedge.runtime.backends.cpu_placement import Placement, cpu_placement, run_placed
from specedge.runtime.bundle import (
    FEATURES_IN,
    FEATURES_KEEP,
    FEATURES_OUT,
    KV_LAYOUT_IN_PLACE,
    ModelSpec,
)
from specedge.runtime.errors import BackendUnavailableError, BundleError
from specedge.runtime.kv_cache import (
    GROWTH_STEP,
    KVCache,
    SlotCaches,
    check_call,
    check_room,
    fill_slot_inputs,
)

MAX_KEPT_T = 16
# Host memory for the buffers of `forward_slots`' bindings, one per call shape (first slot,
# rows, tokens, kept features) and each with a [rows, T, vocab] logits buffer (SmolLM2: 7.9
# MB for 8 rows of 5 tokens): kept up to this many bytes, the least recently used dropped
# first, so that a long-running server's bindings stay bounded whatever shapes it meets.
SLOT_BINDING_BYTES = 256 * 2**20
# The first ONNX Runtime whose CPU GroupQueryAttention takes position_ids, which the fused
# graphs feed it (microsoft/onnxruntime#23944); tested with 1.31.
MIN_ORT_FUSED = (1, 22)
# Batched attention (TensorScatter and Attention of opset 24): tested with 1.31.
MIN_ORT_BATCHED = (1, 31)
# ONNX Runtime's CUDA provider runs fp32 MatMuls in TF32 on Ampere and newer by default
# (use_tf32=1): 10 mantissa bits, enough to flip greedy near-ties, where an fp32 bundle
# promises plain decoding's tokens.
PROVIDER_OPTIONS = {"CUDAExecutionProvider": {"use_tf32": "0"}}



@dataclass
class _Binding:
    """IO binding for one (T tokens, N kept logits, F kept features) shape, with the buffers
    it points to."""

    io: object
    ids: np.ndarray       # [2, 1, T]: input_ids, position_ids
    logits: np.ndarray    # [1, N, vocab]
    presents: np.ndarray | None  # [2 * layers, 1, kv_heads, T, head_dim]: new K, V rows
    #                              (None: the graph writes them into the cache in place)
    features_in: np.ndarray | None   # [1, T, H], a feature draft's input
    features_out: np.ndarray | None  # [1, F, H], a graph's feature output


class OrtCpuBackend:
    """ONNX Runtime, CPU execution provider, with IO binding.

    The cache buffers, the small int inputs and the output buffers are bound by address, so a
    step allocates nothing and copies only the T new K/V rows (nothing, for a graph that
    writes them in place: its presents are bound to the cache buffers). One binding is kept per
    (T, N, F) shape in use (the target alternates K+1 and smaller T, the draft 1 and 2), and
    all are dropped when the cache changes.
    """

    name = "ort-cpu"

    def __init__(self, spec: ModelSpec, threads: int | None = None,
                 one_token_as_two: bool | None = None, spinning: bool = False):
        self.spec = spec
        # GroupQueryAttention (and 4-bit MatMulNBits on some CPUs) compute a one-row call on
        # another kernel path than the rows of a multi-row call, and int8 activations grow
        # the 1e-7 difference to about a logit. Rows of multi-row calls agree bit for bit
        # whatever the call's length, so a target one-token step runs as two rows (the token
        # twice) and keeps the first: the logits equal that position's row of a verification
        # call (docs/design.md#batch-invariance-of-quantized-graphs). Default: in-place graphs.
        self.one_token_as_two = (spec.kv_layout == KV_LAYOUT_IN_PLACE
                                 if one_token_as_two is None else one_token_as_two)
        # Portable and batched graphs attend over the whole capacity, so their cache starts
        # small and grows (a new cache object is bound at its first call);
        # GroupQueryAttention reads only the valid rows, so growing would only copy.
        self.grows_cache = spec.attention != "fused"
        # Spinning threads each on a core of their own (cpu_placement.py).
        self.placement = cpu_placement(threads) if spinning else None
        self.session = open_session(spec, threads, "CPUExecutionProvider", spinning,
                                    self.placement)
        self._inputs, self._outputs = spec.io()
        self._past_length = np.zeros(1, np.int64)
        self._keep = np.zeros(1, np.int64)
        # Whether a graph that takes features_to_keep computes its features (every row) or
        # none: the generator turns them off while no feature draft reads them, which saves
        # a feature draft's fuse product in plain decoding (runtime/bundle.py).
        self.keep_features = True
        self._features_keep = np.zeros(1, np.int64)
        self._cache: KVCache | None = None  # held, so its buffers outlive the bindings
        self._bindings: dict[tuple[int, int, int], _Binding] = {}
        # Calls on several slots of the SlotCaches held (`forward_slots`), per (lo, n, T, F).
        self._slot_caches: SlotCaches | None = None
        self._slot_bindings: OrderedDict[tuple[int, int, int, int], _SlotBinding] = \
            OrderedDict()
        self.slot_binding_bytes = SLOT_BINDING_BYTES
        self.run_seconds = 0.0  # inside ONNX Runtime, for the share of time outside models
        self.features: np.ndarray | None = None  # [T, H] of the last call (feature output)
        # Each row's [len, H] of the last `forward_slots` call (feature output).
        self.slot_features: dict[int, np.ndarray] | None = None

    def new_cache(self, capacity: int) -> KVCache:
        s = self.spec
        # The second row of a one-token step is written past the counted rows.
        return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, capacity,
                       spare=int(self.one_token_as_two))

    def _bind(self, cache: KVCache, t: int, n: int, f: int) -> _Binding:
        """Bind every tensor for T input tokens, N kept logits and F kept features."""
        s = self.spec
        row = (1, s.num_kv_heads, t, s.head_dim)
        in_place = s.kv_layout == KV_LAYOUT_IN_PLACE
        presents = None if in_place else np.zeros((2 * s.num_layers, *row), np.float32)
        width, kept = (1, t, s.features), (1, f, s.features)
        b = _Binding(io=self.session.io_binding(), ids=np.zeros((2, 1, t), np.int64),
                     logits=np.zeros((1, n, s.vocab_size), np.float32), presents=presents,
                     features_in=np.zeros(width, np.float32) if s.reads_features else None,
                     features_out=np.zeros(kept, np.float32) if s.features else None)
        ints = [("input_ids", b.ids[0]), ("position_ids", b.ids[1]),
                ("past_length", self._past_length), ("logits_to_keep", self._keep)]
        if s.keeps_features:
            ints.append((FEATURES_KEEP, self._features_keep))
        for name, arr in ints:
            b.io.bind_input(name, "cpu", 0, np.int64, list(arr.shape), arr.ctypes.data)
        for i in range(s.num_layers):
            for name, buf in ((self._inputs[4 + 2 * i], cache.keys[i]),
                              (self._inputs[5 + 2 * i], cache.values[i])):
                b.io.bind_input(name, "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
        b.io.bind_output("logits", "cpu", 0, np.float32, list(b.logits.shape),
                         b.logits.ctypes.data)
        for j, name in enumerate(self._outputs[1:1 + 2 * s.num_layers]):
            buf = cache.planes[j] if in_place else b.presents[j]
            b.io.bind_output(name, "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
        if b.features_in is not None:
            b.io.bind_input(FEATURES_IN, "cpu", 0, np.float32, list(width),
                            b.features_in.ctypes.data)
        if b.features_out is not None:
            b.io.bind_output(FEATURES_OUT, "cpu", 0, np.float32, list(kept),
                             b.features_out.ctypes.data)
        return b

    def forward(self, cache: KVCache, token_ids: list[int] | np.ndarray,
                logits_to_keep: int = 1, features: np.ndarray | None = None) -> np.ndarray:
        """Run T tokens; returns logits [logits_to_keep, vocab] (a view, valid until the next
        call with the same T and logits_to_keep) and appends their K/V rows to `cache`.
        A feature draft takes `features` [T, H]; a graph with feature output leaves its
        [T, H] in `self.features` (a view, valid as long as the logits), or None where
        `keep_features` is off."""
        t = len(token_ids)
        check_call(cache, t, logits_to_keep)
        if self.spec.reads_features and (features is None or len(features) != t):
            raise ValueError(f"a feature draft needs features for each of the {t} tokens")
        if self._cache is not cache:
            self._cache, self._bindings = cache, {}
        # A one-token step as two rows, where the second row has room in the cache and a
        # position inside the context (at the context's last position it runs alone).
        padded = bool(t == 1 and self.one_token_as_two and cache.spare
                      and cache.length + 2 <= self.spec.max_context)
        if padded:
            token_ids, t, logits_to_keep = [token_ids[0]] * 2, 2, 2
        f = t if self.keep_features or not self.spec.keeps_features else 0
        key = (t, logits_to_keep, f)
        b = self._bindings.get(key)
        if b is None:
            b = self._bind(cache, t, logits_to_keep, f)
            if t <= MAX_KEPT_T:  # decode shapes recur; a prefill's length rarely does
                self._bindings[key] = b
        b.ids[0, 0] = token_ids
        if b.features_in is not None:
            b.features_in[0] = features
        b.ids[1, 0] = np.arange(cache.length, cache.length + t)
        self._past_length[0] = cache.length
        self._keep[0] = logits_to_keep
        self._features_keep[0] = f
        t0 = time.perf_counter()
        run_placed(self.session, b.io, self.placement)
        self.run_seconds += time.perf_counter() - t0
        if b.presents is None:
            cache.advance(t - padded)
        else:
            cache.write(b.presents[:, :, :, :t - padded])
        self.features = None if b.features_out is None or not f else \
            b.features_out[0][:t - padded]
        return b.logits[0][:1] if padded else b.logits[0]

    def forget_bindings(self) -> None:
        """Drop every binding: the buffers of a cache they point to were replaced
        (SlotCaches.grow)."""
        self._cache, self._bindings = None, {}
        self._slot_caches, self._slot_bindings = None, OrderedDict()

    def new_slot_caches(self, slots: int, spare: int = 0) -> SlotCaches:
        """The caches of `slots` sequences decoded together (batch.py), GROWTH_STEP rows
        each to start with (they grow with the longest)."""
        s = self.spec
        return SlotCaches(s.num_layers, s.num_kv_heads, s.head_dim,
                          min(GROWTH_STEP, s.max_context), slots, spare)

    def forward_slots(self, caches: SlotCaches, lo: int, rows: dict[int, list[int]],
                      features: dict[int, np.ndarray] | None = None
                      ) -> dict[int, np.ndarray]:
        """One call on slots [lo, hi) of `caches` (hi past the last slot in `rows`): slot s
        runs the tokens rows[s] at its positions [length, length + len). Rows are padded to
        the longest with their last token; a slot in the range without a row runs padding
        at its own length and keeps its rows. Returns each row's logits [len, vocab] (views,
        valid until the next call) and appends its K/V rows to its slot.

        A feature draft takes each row's `features` [len, H]; a graph with feature output
        leaves each row's [len, H] in `self.slot_features` (views, valid as long as the
        logits), or None where `keep_features` is off.

        Graphs that take several rows of several tokens (runtime/bundle.py): portable ones,
        whose new rows are copied into the slots, and batched ones, which write every row's
        new rows (the padding's too, past the counted rows) into the slots in place. The
        caller gives every slot of the range room for the call's T rows (batch.py). Each
        row computes what a verification call computes (a call of one row and one token
        on an in-place target runs as two tokens, as `forward`'s one-token step does)."""
        check_batch_rows(self.spec)
        in_place = self.spec.kv_layout == KV_LAYOUT_IN_PLACE
        hi = max(rows) + 1
        n, t = hi - lo, max(len(ids) for ids in rows.values())
        for slot, ids in rows.items():
            check_call(caches.slots[slot], len(ids), 1)
        # One token a row on an in-place target: a call of one row runs as two, as
        # `forward` runs a one-token step; a call of several rows is a multi-row call
        # already, and a batched graph's attention never takes its one-query path
        # (export/graph/attention.py, `ScatterAttention`).
        padded = t == 1 and n == 1 and self.one_token_as_two and in_place
        t += padded
        if in_place:
            for cache in caches.slots[lo:hi]:
                check_room(cache.length, t, caches.capacity + caches.spare)
        s = self.spec
        if s.reads_features and (features is None or any(
                len(features.get(slot, ())) != len(ids) for slot, ids in rows.items())):
            raise ValueError("a feature draft needs features for each token of each row")
        if self._slot_caches is not caches:
            self._slot_caches, self._slot_bindings = caches, OrderedDict()
        f = t if self.keep_features or not s.keeps_features else 0
        b = self._slot_binding(caches, (lo, n, t, f))
        fill_slot_inputs(caches.slots, lo, rows, s.max_context, *b.ids, b.past_length)
        if b.features_in is not None:
            # A row padded to T repeats its last feature, as its tokens repeat their last;
            # a slot without a row reads zeros. What padding computes is dropped.
            b.features_in.fill(0.0)
            for slot, rows_in in features.items():
                if slot in rows:
                    b.features_in[slot - lo, :len(rows_in)] = rows_in
                    b.features_in[slot - lo, len(rows_in):] = rows_in[-1]
        t0 = time.perf_counter()
        run_placed(self.session, b.io, self.placement)
        self.run_seconds += time.perf_counter() - t0
        logits = {}
        for slot, tokens in rows.items():
            if b.presents is None:
                caches.slots[slot].advance(len(tokens))
            else:
                caches.slots[slot].write(b.presents[:, slot - lo:slot - lo + 1, :, :len(tokens)])
            logits[slot] = b.logits[slot - lo, :len(tokens)]
        self.slot_features = None if b.features_out is None or not f else {
            slot: b.features_out[slot - lo, :len(tokens)] for slot, tokens in rows.items()}
        return logits

    def _slot_binding(self, caches: SlotCaches, key: tuple[int, int, int, int]
                      ) -> _SlotBinding:
        """The binding of a call shape (lo, n, T, F), made if need be; the bindings' buffers
        kept within `slot_binding_bytes`, the least recently used dropped first."""
        b = self._slot_bindings.get(key)
        if b is not None:
            self._slot_bindings.move_to_end(key)
            return b
        b = self._slot_bindings[key] = self._bind_slots(caches, *key)
        while len(self._slot_bindings) > 1 and self.slot_bindings_nbytes > \
                self.slot_binding_bytes:
            self._slot_bindings.popitem(last=False)
        return b

    @property
    def slot_bindings_nbytes(self) -> int:
        """Host memory held by the bindings of `forward_slots` (their own buffers)."""
        return sum(b.nbytes for b in self._slot_bindings.values())

    def _bind_slots(self, caches: SlotCaches, lo: int, n: int, t: int, f: int
                    ) -> _SlotBinding:
        """Bind every tensor of a call on n slots from `lo`, T tokens each, F kept features."""
        s = self.spec
        block = caches.block(lo, lo + n)
        in_place = s.kv_layout == KV_LAYOUT_IN_PLACE
        presents = None if in_place else np.zeros((2 * s.num_layers, n, s.num_kv_heads, t,
                                                   s.head_dim), np.float32)
        b = _SlotBinding(io=self.session.io_binding(), ids=np.zeros((2, n, t), np.int64),
                         past_length=np.zeros(n, np.int64), keep=np.array([t], np.int64),
                         logits=np.zeros((n, t, s.vocab_size), np.float32),
                         presents=presents, block=block, features_keep=np.array([f], np.int64),
                         features_in=(np.zeros((n, t, s.features), np.float32)
                                      if s.reads_features else None),
                         features_out=(np.zeros((n, f if s.keeps_features else t, s.features),
                                                np.float32) if s.features else None))
        ints = [("input_ids", b.ids[0]), ("position_ids", b.ids[1]),
                ("past_length", b.past_length), ("logits_to_keep", b.keep)]
        if s.keeps_features:
            ints.append((FEATURES_KEEP, b.features_keep))
        for name, arr in ints:
            b.io.bind_input(name, "cpu", 0, np.int64, list(arr.shape), arr.ctypes.data)
        for name, arr, bind in ((FEATURES_IN, b.features_in, b.io.bind_input),
                                (FEATURES_OUT, b.features_out, b.io.bind_output)):
            if arr is not None:
                bind(name, "cpu", 0, np.float32, list(arr.shape), arr.ctypes.data)
        for j, name in enumerate(self._inputs[4:4 + 2 * s.num_layers]):
            plane = block[j]
            b.io.bind_input(name, "cpu", 0, np.float32, list(plane.shape), plane.ctypes.data)
        b.io.bind_output("logits", "cpu", 0, np.float32, list(b.logits.shape),
                         b.logits.ctypes.data)
        for j, name in enumerate(self._outputs[1:1 + 2 * s.num_layers]):
            buf = block[j] if in_place else b.presents[j]
            b.io.bind_output(name, "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
        return b


@dataclass
class _SlotBinding:
    """IO binding of a call on n consecutive slots of a SlotCaches, T tokens each."""

    io: object
    ids: np.ndarray          # [2, n, T]: input_ids, position_ids
    past_length: np.ndarray  # [n]
    keep: np.ndarray         # [1] = T: every position's logits
    logits: np.ndarray       # [n, T, vocab]
    presents: np.ndarray | None  # [2 * layers, n, kv_heads, T, head_dim]; None: in place
    block: np.ndarray        # the slots' planes, held while bound
    features_keep: np.ndarray  # [1] = F: T, or 0 where `keep_features` is off
    features_in: np.ndarray | None   # [n, T, H], a feature draft's input
    features_out: np.ndarray | None  # [n, F, H] (a draft's: [n, T, H]), feature output

    @property
    def nbytes(self) -> int:
        """The buffers it owns (not the slots' planes, which the caches own)."""
        return sum(a.nbytes for a in (self.ids, self.past_length, self.keep, self.logits,
                                      self.presents, self.features_keep, self.features_in,
                                      self.features_out) if a is not None)


def check_batch_rows(spec: ModelSpec) -> None:
    """Raise ValueError, saying what to export, unless the graph takes several rows of
    several tokens in one call (`forward_slots`)."""
    if spec.attention == "fused":
        raise ValueError(f"{spec.path} runs attention on ONNX Runtime's GroupQueryAttention, "
                         "whose CPU kernel takes several rows one token each only: for "
                         "batched decoding, export the bundle with --attention batched")
    if not spec.batch_rows:
        raise ValueError(f"{spec.path} takes one row a call (bundle format 3 or older): "
                         "re-export the bundle for batched decoding")


def _check_graph(session, spec: ModelSpec, names: list[str]) -> None:
    """The graph must have the contract's inputs and the manifest's static sizes."""
    inputs = {i.name: i.shape for i in session.get_inputs()}
    if set(inputs) != set(names):
        raise BundleError(f"{spec.path} does not have the bundle's inputs (expected "
                          f"{names[:5]}...); re-export the bundle")
    checks = [("num_kv_heads", inputs[names[4]][1], spec.num_kv_heads),
              ("head_dim", inputs[names[4]][3], spec.head_dim),
              ("vocab_size", session.get_outputs()[0].shape[2], spec.vocab_size)]
    for field, graph_value, manifest_value in checks:
        if isinstance(graph_value, int) and graph_value != manifest_value:
            raise BundleError(f"{spec.path} has {field} {graph_value} but the manifest says "
                              f"{manifest_value}: the manifest does not describe this graph; "
                              "re-export the bundle")


def open_session(spec: ModelSpec, threads: int | None, provider: str,
                 spinning: bool = False, placement: Placement | None = None):
    """An ONNX Runtime session for one graph of a bundle, checked against the contract;
    `threads` intra-op threads (None: ONNX Runtime's choice, one per physical core) that
    spin while they wait for work when `spinning`, the workers pinned where `placement`
    says (its runs then go through `run_placed`)."""
    import onnxruntime as ort

    here = tuple(int(p) for p in ort.__version__.split(".")[:2])
    if spec.kv_layout == KV_LAYOUT_IN_PLACE and here < MIN_ORT_FUSED:
        raise BackendUnavailableError(
            f"{spec.path} uses ONNX Runtime's GroupQueryAttention with position_ids, which "
            f"needs onnxruntime >= {'.'.join(map(str, MIN_ORT_FUSED))} (this is "
            f"{ort.__version__}): pip install -U onnxruntime, or export the bundle with "
            "--attention portable")
    if spec.attention == "batched" and here < MIN_ORT_BATCHED:
        raise BackendUnavailableError(
            f"{spec.path} uses ONNX's TensorScatter and Attention (opset 24), tested with "
            f"onnxruntime >= {'.'.join(map(str, MIN_ORT_BATCHED))} (this is "
            f"{ort.__version__}): pip install -U onnxruntime, or export the bundle with "
            "--attention fused or portable")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    for key, value in spinning_entries(spinning).items():
        options.add_session_config_entry(key, value)
    if placement is not None:
        options.intra_op_num_threads = placement.threads
        options.add_session_config_entry("session.intra_op_thread_affinities", placement.workers)
    try:
        session = ort.InferenceSession(str(spec.path), options,
                                       providers=[(provider, PROVIDER_OPTIONS.get(provider, {}))])
    except Exception as e:  # ORT raises several types for unreadable graphs
        raise BundleError(f"ONNX Runtime could not load {spec.path}: {e}; the file is "
                          "corrupt or not an ONNX graph: re-export the bundle") from e
    _check_graph(session, spec, spec.io()[0])
    return session


def spinning_entries(spinning: bool) -> dict[str, str]:
    """The session config entries of `spinning`.

    A pool's threads that wait for work spin (busy-wait) for a while before they sleep, in
    ONNX Runtime's default, which shortens the wait for the next parallel section but keeps
    them on the cores. Off, they sleep at once: on a device whose cores also run other
    processes, spinning threads take the cores that the thread doing the work needs
    (docs/design.md#threads). On, the pools still stop spinning at the end of each run:
    target and draft run one after the other, each with its own pool, and a pool that spins
    after its run takes the cores the other session's run needs (on 2 cores that made a
    K=2 step run at 0.6x plain decoding, and 0.86x once pools stopped at the end of a run).
    Off, that stop changes nothing, as a pool that may not spin never does."""
    return {"session.intra_op.allow_spinning": "1" if spinning else "0",
            "session.force_spinning_stop": "1"}
