// mkc device library: speculative decoding's rules, one definition for the
// host and the device: which drafts a verify step accepts, and the
// prompt-lookup (n-gram) drafter that needs no model.
//
// A verify step takes T tokens of a sequence: its last accepted token, then
// T - 1 drafts. The model's greedy choice after each prefix (the argmax at
// each of the T positions) decides: drafts stand while each equals the
// choice before it, and the choice after the last standing one is the next
// token. So a step yields between 1 and T tokens, exactly the tokens greedy
// decoding would give one step at a time, whatever the drafts were.
#pragma once

#include <cstdint>

#ifndef MKC_HOST_DEVICE
#ifdef __CUDACC__
#define MKC_HOST_DEVICE __host__ __device__
#else
#define MKC_HOST_DEVICE
#endif
#endif

namespace mkc {

// tokens[0..t): the last accepted token and t - 1 drafts; argmax[0..t): the
// greedy choice after tokens[0..i]. Returns how many drafts stand (0 to
// t - 1): draft i + 1 stands while it equals argmax[i]. The step's tokens
// are those drafts and then argmax[accepted].
MKC_HOST_DEVICE inline uint32_t accepted_drafts(const int32_t* tokens, const int32_t* argmax, uint32_t t) {
  uint32_t accepted = 0;
  while (accepted + 1 < t && tokens[accepted + 1] == argmax[accepted]) ++accepted;
  return accepted;
}

// Prompt lookup, as transformers' PromptLookupCandidateGenerator: for n from
// max_n down to min_n (at least 1), the last n tokens of history[0..len) are
// looked for earlier in it, the earliest occurrence first; the tokens that
// follow the first occurrence with any after it (up to max_draft, not past
// the history's end) are the drafts, written to out. Returns how many (0: no
// n-gram of those sizes recurs).
MKC_HOST_DEVICE inline uint32_t ngram_draft(const int32_t* history, uint32_t len, uint32_t min_n, uint32_t max_n,
                                            uint32_t max_draft, int32_t* out) {
  if (min_n == 0) min_n = 1;
  for (uint32_t n = max_n; n >= min_n; --n) {
    if (n >= len) continue;  // no earlier place for the whole history
    const int32_t* tail = history + len - n;
    for (uint32_t i = 0; i + n < len; ++i) {  // an occurrence with a token after it
      uint32_t j = 0;
      while (j < n && history[i + j] == tail[j]) ++j;
      if (j < n) continue;
      const uint32_t after = len - (i + n), count = after < max_draft ? after : max_draft;
      for (uint32_t k = 0; k < count; ++k) out[k] = history[i + n + k];
      return count;
    }
  }
  return 0;
}

}  // namespace mkc
