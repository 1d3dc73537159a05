/* mkc runtime: reading a Hugging Face checkpoint directory (C ABI).
 *
 * A checkpoint is `model.safetensors`, or shards listed by
 * `model.safetensors.index.json` (or, lacking an index, every `*.safetensors`
 * in the directory). Opening reads the headers only; tensors are read on
 * demand. Checking compares the tensors a plan needs (key, dtype, shape) with
 * the headers and reports one line per problem, naming the tensor:
 *
 *   missing tensor K (DT [shape])
 *   wrong shape for K: [found] in FILE, the plan needs [shape]
 *   wrong dtype for K: FOUND in FILE, the plan needs DT
 *   truncated tensor K in FILE: DETAIL
 *   duplicate tensor K: in FILE and in FILE2
 *   unreadable file FILE: DETAIL
 *
 * Opening refuses what the compiler's checker refuses, with its messages
 * (docs/check.md, "What a checkpoint must be"): a FIFO or other non-regular
 * file is refused without blocking, a header must be strict JSON whose
 * tensors cover the data section exactly, and sizes never wrap. A file with
 * a broken header is one `unreadable file` line; its tensors are not loaded.
 *
 * A tensor declared F32 may be stored as BF16 or F16 (widened exactly on
 * upload), as in the compiler's own checker (src/checkpoint).
 */
#ifndef MKC_CHECKPOINT_H
#define MKC_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MKC_MAX_DIMS 8

/* One tensor a plan needs. */
typedef struct mkc_tensor_spec {
  const char* key;
  const char* dtype; /* safetensors name: BF16, F32, F8_E4M3, U8, ... */
  uint32_t ndim;
  uint64_t shape[MKC_MAX_DIMS];
} mkc_tensor_spec;

typedef struct mkc_checkpoint mkc_checkpoint;

/* Opens `dir`. Returns 0, or -1 with a message in err (always NUL-terminated). */
int mkc_checkpoint_open(const char* dir, mkc_checkpoint** out, char* err, size_t err_len);

/* Checks `n` specs. Returns the number of problems (0: the checkpoint matches)
 * and writes them, one per line, to report (truncated to report_len). */
int mkc_checkpoint_check(const mkc_checkpoint* ckpt, const mkc_tensor_spec* specs, size_t n, char* report,
                         size_t report_len);

/* Number of tensors in the checkpoint. */
size_t mkc_checkpoint_tensor_count(const mkc_checkpoint* ckpt);

/* Reads tensor `key` into dst, which holds dst_len bytes. Returns the tensor's
 * size in bytes, or -1 with a message in err (missing tensor, short buffer,
 * truncated file). */
int64_t mkc_checkpoint_read(const mkc_checkpoint* ckpt, const char* key, void* dst, size_t dst_len, char* err,
                            size_t err_len);

/* The stored dtype of tensor `key` (safetensors name), or NULL if absent. */
const char* mkc_checkpoint_dtype(const mkc_checkpoint* ckpt, const char* key);

void mkc_checkpoint_close(mkc_checkpoint* ckpt);

#ifdef __cplusplus
}
#endif

#endif /* MKC_CHECKPOINT_H */
