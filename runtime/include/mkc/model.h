/* mkc runtime: one compiled model behind a C ABI. Each generated model
 * (generated/<model>_<target>/model.cu) implements these functions; the
 * Python binding (python/mkc_runtime.py) and tools/generate.cpp use them.
 *
 * Functions returning int return 0 on success, or -1 with a message in err
 * (always NUL-terminated) naming what failed: a tensor of the checkpoint, a
 * CUDA call, a token outside the vocabulary, a full context.
 */
#ifndef MKC_MODEL_H
#define MKC_MODEL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mkc_model mkc_model;

typedef struct mkc_model_info {
  const char* name;      /* the generated program, e.g. "kimi_k2_tiny_h200" */
  uint32_t batch;        /* sequences decoded together */
  uint64_t vocab;        /* logits per sequence */
  uint64_t context;      /* tokens each sequence may hold */
  uint64_t state_bytes;  /* what mkc_model_save_state writes */
  uint32_t routers;      /* MoE routers, in graph order (mkc_model_routing) */
  uint32_t router_top_k; /* experts each router picks per sequence (0: they differ) */
  uint32_t positions;    /* rows a sequence holds in a step: a verify step's positions (1: plain
                          * decoding); batch / positions sequences */
} mkc_model_info;

/* Reads the plan file (plan.mkcplan, written by `mkc codegen`) beside this
 * library, checks it is this model's (format, model, target, batch, context,
 * checksum), checks the checkpoint in `dir` against its weight table (every
 * tensor, by name), uploads it and allocates caches and state on the current
 * CUDA device. */
int mkc_model_open(const char* dir, mkc_model** out, char* err, size_t err_len);

/* As mkc_model_open, with the plan file at `plan`. */
int mkc_model_open_plan(const char* dir, const char* plan, mkc_model** out, char* err, size_t err_len);

void mkc_model_get_info(const mkc_model* m, mkc_model_info* info);

/* One decode step: tokens[batch] in, next[batch] (greedy) out, and logits
 * [batch, vocab] if not NULL. debug != 0 runs the debug kernel, whose waits
 * are bounded and report (SM, instruction, counter, expected, seen). */
int mkc_model_step(mkc_model* m, const int32_t* tokens, int32_t* next, float* logits, int debug, char* err,
                   size_t err_len);

/* A speculative verify step (a program of positions > 1, `mkc codegen
 * --positions`): tokens[sequence][position] are each sequence's last accepted
 * token and then positions - 1 drafts. Drafts stand while each equals the
 * greedy choice after the tokens before it (mkc/speculative.h); writes
 * accepted[sequence] (the standing drafts, 0 to positions - 1) and
 * next[sequence] (the greedy choice after the last of them), and if not NULL
 * argmax[batch] (every row's greedy choice) and logits[batch, vocab]. Each
 * sequence advances by accepted + 1 positions: the same tokens and state as
 * that many mkc_model_step calls. Refuses a step that would pass the
 * context. */
int mkc_model_verify(mkc_model* m, const int32_t* tokens, int32_t* accepted, int32_t* next, int32_t* argmax,
                     float* logits, char* err, size_t err_len);

/* Greedy generation with speculation (a verify program) in one persistent
 * launch: history[sequence][len] is each sequence's tokens so far, the last
 * not yet decoded (its state holds the others); each step's drafts come from
 * prompt lookup, on the device, over each sequence's history and what it has
 * generated (mkc/speculative.h's ngram_draft, n-grams of 1 to 3), and the
 * step's acceptance and state commit run on the device between steps.
 * Writes out[sequence][n], the same tokens as n mkc_model_step calls, and
 * *steps (verify steps taken); every sequence ends n positions on. */
int mkc_model_generate_speculative(mkc_model* m, const int32_t* history, uint32_t len, uint32_t n, int32_t* out,
                                   uint32_t* steps, char* err, size_t err_len);

/* Greedy generation in one persistent launch: tokens[batch] are the first
 * step's tokens; each step's next tokens are fed back as the following
 * step's, positions advancing on the device, for n steps or until every
 * sequence has produced `stop` (-1: no stop token). Writes out[steps][batch]
 * (each step's next tokens), length[batch] (the step, from 1, at which the
 * sequence produced `stop`; 0 if it did not) and *steps. Sequences that
 * stopped early decode on with the others; their state holds every token
 * fed. The same tokens as *steps calls of mkc_model_step. Refuses n that
 * would pass the context. */
int mkc_model_generate(mkc_model* m, const int32_t* tokens, uint32_t n, int32_t stop, int32_t* out, int32_t* length,
                       uint32_t* steps, char* err, size_t err_len);

/* Benchmark: n steps back to back at the current positions (positions do
 * not advance), after `warmup` untimed ones; writes milliseconds per step. */
int mkc_model_time_steps(mkc_model* m, const int32_t* tokens, int warmup, int n, float* ms_per_step, char* err,
                         size_t err_len);

/* One step (as mkc_model_step, no logits) with per-instruction timestamps,
 * written to trace_path as Chrome trace JSON: a row per SM. */
int mkc_model_profile_step(mkc_model* m, const int32_t* tokens, int32_t* next, const char* trace_path, char* err,
                           size_t err_len);

/* The expert ids every router picked in the last step, [router][batch][top_k]
 * in graph order (n: the sum over routers of batch x top_k), to compare the
 * routing with a reference's. */
int mkc_model_routing(const mkc_model* m, int32_t* ids, size_t n, char* err, size_t err_len);

/* Every sequence back to position 0, its state (KV caches, conv windows,
 * recurrent state) zeroed. */
int mkc_model_reset(mkc_model* m, char* err, size_t err_len);

/* Positions, KV caches and recurrent state, to restart a decode later. */
int mkc_model_save_state(const mkc_model* m, void* dst, size_t len, char* err, size_t err_len);
int mkc_model_load_state(mkc_model* m, const void* src, size_t len, char* err, size_t err_len);

void mkc_model_close(mkc_model* m);

#ifdef __cplusplus
}
#endif

#endif /* MKC_MODEL_H */
