"""Python binding of a compiled mkc model (the C ABI of runtime/include/mkc/model.h).

    from mkc_runtime import Model
    m = Model("target/models/kimi_k2_tiny_h200/libkimi_k2_tiny_h200.so", "/path/to/checkpoint")
    next_tokens, logits = m.step([token] * m.batch)

ctypes only (numpy for the arrays); errors from the runtime become MkcError
with the runtime's message (which names the tensor, the CUDA call, ...).
"""

import ctypes

import numpy as np


class MkcError(RuntimeError):
    pass


class _Info(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("batch", ctypes.c_uint32),
        ("vocab", ctypes.c_uint64),
        ("context", ctypes.c_uint64),
        ("state_bytes", ctypes.c_uint64),
        ("routers", ctypes.c_uint32),
        ("router_top_k", ctypes.c_uint32),
        ("positions", ctypes.c_uint32),
    ]


class Model:
    def __init__(self, library, checkpoint, plan=None):
        """Opens `checkpoint` with `library`; its plan file is plan.mkcplan beside
        the library unless `plan` names one."""
        self._lib = ctypes.CDLL(str(library))
        lib = self._lib
        lib.mkc_model_open.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t]
        lib.mkc_model_get_info.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Info)]
        lib.mkc_model_step.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_char_p, ctypes.c_size_t]
        lib.mkc_model_reset.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.mkc_model_save_state.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p,
                                             ctypes.c_size_t]
        lib.mkc_model_load_state.argtypes = lib.mkc_model_save_state.argtypes
        lib.mkc_model_close.argtypes = [ctypes.c_void_p]
        lib.mkc_model_routing.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p,
                                          ctypes.c_size_t]
        lib.mkc_model_profile_step.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                                               ctypes.c_char_p, ctypes.c_size_t]
        if hasattr(lib, "mkc_model_verify"):  # libraries built before it lack it (bench/compare.sh's baselines)
            lib.mkc_model_verify.argtypes = [ctypes.c_void_p] + [ctypes.c_void_p] * 5 + [ctypes.c_char_p,
                                                                                        ctypes.c_size_t]
        if hasattr(lib, "mkc_model_generate_speculative"):
            lib.mkc_model_generate_speculative.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32,
                                                           ctypes.c_uint32, ctypes.c_void_p,
                                                           ctypes.POINTER(ctypes.c_uint32), ctypes.c_char_p,
                                                           ctypes.c_size_t]
        if hasattr(lib, "mkc_model_generate"):  # libraries built before it lack it (bench/compare.sh's baselines)
            lib.mkc_model_generate.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int32,
                                               ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32),
                                               ctypes.c_char_p, ctypes.c_size_t]
        lib.mkc_model_time_steps.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                             ctypes.POINTER(ctypes.c_float), ctypes.c_char_p, ctypes.c_size_t]
        self._err = ctypes.create_string_buffer(1 << 16)
        handle = ctypes.c_void_p()
        if plan is None:
            rc = lib.mkc_model_open(str(checkpoint).encode(), ctypes.byref(handle), self._err, len(self._err))
        else:
            lib.mkc_model_open_plan.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                                                ctypes.c_char_p, ctypes.c_size_t]
            rc = lib.mkc_model_open_plan(str(checkpoint).encode(), str(plan).encode(), ctypes.byref(handle), self._err,
                                         len(self._err))
        if rc != 0:
            raise MkcError(self._err.value.decode())
        self._m = handle
        info = _Info()
        lib.mkc_model_get_info(self._m, ctypes.byref(info))
        self.name = info.name.decode()
        self.batch = info.batch
        self.vocab = info.vocab
        self.context = info.context
        self.state_bytes = info.state_bytes
        self.routers = info.routers
        self.router_top_k = info.router_top_k
        # Rows a sequence holds (a verify step's positions); libraries built before the field leave it 0.
        self.positions = info.positions or 1
        self.sequences = self.batch // self.positions

    def step(self, tokens, debug=False):
        """One decode step; returns (next tokens [batch] int32, logits [batch, vocab] float32)."""
        t = np.ascontiguousarray(np.asarray(tokens, dtype=np.int32).reshape(self.batch))
        nxt = np.zeros(self.batch, dtype=np.int32)
        logits = np.zeros((self.batch, self.vocab), dtype=np.float32)
        if self._lib.mkc_model_step(self._m, t.ctypes.data, nxt.ctypes.data, logits.ctypes.data, int(debug), self._err,
                                    len(self._err)) != 0:
            raise MkcError(self._err.value.decode())
        return nxt, logits

    def verify(self, tokens):
        """A speculative verify step (a library of positions > 1): tokens [sequences, positions], each
        sequence's last accepted token then its drafts. Returns (accepted [sequences] int32: the drafts
        that stand, next [sequences] int32: the greedy token after them, argmax [sequences, positions]
        int32, logits [sequences, positions, vocab] float32); each sequence advances accepted + 1."""
        if not hasattr(self._lib, "mkc_model_verify"):
            raise MkcError(f"{self.name}: this library was built before mkc_model_verify")
        t = np.ascontiguousarray(np.asarray(tokens, dtype=np.int32).reshape(self.batch))
        accepted = np.zeros(self.sequences, dtype=np.int32)
        nxt = np.zeros(self.sequences, dtype=np.int32)
        argmax = np.zeros(self.batch, dtype=np.int32)
        logits = np.zeros((self.batch, self.vocab), dtype=np.float32)
        if self._lib.mkc_model_verify(self._m, t.ctypes.data, accepted.ctypes.data, nxt.ctypes.data,
                                      argmax.ctypes.data, logits.ctypes.data, self._err, len(self._err)) != 0:
            raise MkcError(self._err.value.decode())
        shape = (self.sequences, self.positions)
        return accepted, nxt, argmax.reshape(shape), logits.reshape(shape + (self.vocab,))

    def generate_speculative(self, history, n):
        """Greedy generation with prompt-lookup speculation in one launch (a library of positions > 1):
        history [sequences, len] each sequence's tokens so far, the last not yet decoded. Returns (tokens
        [sequences, n] int32, the same as n single steps; verify steps taken)."""
        if not hasattr(self._lib, "mkc_model_generate_speculative"):
            raise MkcError(f"{self.name}: this library was built before mkc_model_generate_speculative")
        h = np.ascontiguousarray(np.asarray(history, dtype=np.int32).reshape(self.sequences, -1))
        out = np.zeros((self.sequences, n), dtype=np.int32)
        steps = ctypes.c_uint32()
        if self._lib.mkc_model_generate_speculative(self._m, h.ctypes.data, h.shape[1], n, out.ctypes.data,
                                                    ctypes.byref(steps), self._err, len(self._err)) != 0:
            raise MkcError(self._err.value.decode())
        return out, steps.value

    def generate(self, tokens, n, stop=-1):
        """Greedy generation in one launch: up to n steps from tokens [batch], each step's next tokens fed
        back, stopping early once every sequence has produced `stop`. Returns (tokens [steps, batch] int32,
        length [batch] int32: the step, from 1, at which each sequence produced `stop`, or 0)."""
        if not hasattr(self._lib, "mkc_model_generate"):
            raise MkcError(f"{self.name}: this library was built before mkc_model_generate")
        t = np.ascontiguousarray(np.asarray(tokens, dtype=np.int32).reshape(self.batch))
        out = np.zeros((n, self.batch), dtype=np.int32)
        length = np.zeros(self.batch, dtype=np.int32)
        steps = ctypes.c_uint32()
        if self._lib.mkc_model_generate(self._m, t.ctypes.data, n, stop, out.ctypes.data, length.ctypes.data,
                                        ctypes.byref(steps), self._err, len(self._err)) != 0:
            raise MkcError(self._err.value.decode())
        return out[:steps.value], length

    def time_steps(self, tokens, warmup=10, n=100):
        """Milliseconds per step, n steps back to back at the current positions (CUDA events)."""
        t = np.ascontiguousarray(np.asarray(tokens, dtype=np.int32).reshape(self.batch))
        ms = ctypes.c_float()
        if self._lib.mkc_model_time_steps(self._m, t.ctypes.data, warmup, n, ctypes.byref(ms), self._err,
                                          len(self._err)) != 0:
            raise MkcError(self._err.value.decode())
        return ms.value

    def profile_step(self, tokens, trace_path):
        """One step with per-instruction timestamps written to trace_path (Chrome trace JSON); returns next tokens."""
        t = np.ascontiguousarray(np.asarray(tokens, dtype=np.int32).reshape(self.batch))
        nxt = np.zeros(self.batch, dtype=np.int32)
        if self._lib.mkc_model_profile_step(self._m, t.ctypes.data, nxt.ctypes.data, str(trace_path).encode(),
                                            self._err, len(self._err)) != 0:
            raise MkcError(self._err.value.decode())
        return nxt

    def routing(self):
        """The expert ids each router picked in the last step: [routers, batch, top_k] int32,
        routers in graph order."""
        if self.router_top_k == 0:
            raise MkcError(f"{self.name}: {self.routers} routers of different top-k (or none) to read")
        ids = np.zeros((self.routers, self.batch, self.router_top_k), dtype=np.int32)
        if self._lib.mkc_model_routing(self._m, ids.ctypes.data, ids.size, self._err, len(self._err)) != 0:
            raise MkcError(self._err.value.decode())
        return ids

    def reset(self):
        if self._lib.mkc_model_reset(self._m, self._err, len(self._err)) != 0:
            raise MkcError(self._err.value.decode())

    def save_state(self):
        buf = np.zeros(self.state_bytes, dtype=np.uint8)
        if self._lib.mkc_model_save_state(self._m, buf.ctypes.data, buf.size, self._err, len(self._err)) != 0:
            raise MkcError(self._err.value.decode())
        return buf

    def load_state(self, buf):
        buf = np.ascontiguousarray(buf, dtype=np.uint8)
        if self._lib.mkc_model_load_state(self._m, buf.ctypes.data, buf.size, self._err, len(self._err)) != 0:
            raise MkcError(self._err.value.decode())

    def close(self):
        if getattr(self, "_m", None):
            self._lib.mkc_model_close(self._m)
            self._m = None

    def __del__(self):
        self.close()
