// CPU test of speculative decoding's rules (device/mkc/speculative.h): the
// accepted drafts on chosen cases; the prompt-lookup drafter against a
// reference written with std::search on random histories of a small
// vocabulary (so that n-grams recur); and the property the two exist for:
// decoding with drafts (the drafter's, random ones, all wrong, all right)
// and the acceptance rule gives exactly the tokens of plain greedy decoding,
// with a deterministic toy model standing in for the megakernel's argmax.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "expect.h"
#include "mkc/speculative.h"

namespace {

using Tokens = std::vector<int32_t>;

// The drafter's definition, written another way.
Tokens reference_draft(const Tokens& h, uint32_t min_n, uint32_t max_n, uint32_t max_draft) {
  for (uint32_t n = max_n; n >= std::max(min_n, 1u); --n) {
    if (n >= h.size()) continue;
    const auto tail = h.end() - n;
    // The earliest occurrence that ends before the history does.
    const auto at = std::search(h.begin(), h.end() - 1, tail, h.end());
    if (at + n < h.end()) {
      const auto from = at + n;
      return Tokens(from, from + std::min<size_t>(max_draft, h.end() - from));
    }
  }
  return {};
}

// A deterministic model over a vocabulary of v: the greedy next token after
// a prefix, from its last three tokens and its length.
int32_t toy_argmax(const Tokens& prefix, int32_t v) {
  uint64_t x = prefix.size() * 0x9E3779B97F4A7C15ull;
  for (size_t i = prefix.size() >= 3 ? prefix.size() - 3 : 0; i < prefix.size(); ++i) {
    x = (x ^ uint64_t(prefix[i])) * 0xBF58476D1CE4E5B9ull;
  }
  // Repetitive: a short cycle most of the time, so prompt lookup finds drafts.
  return int32_t((x >> 60) < 12 ? prefix.back() % 5 + 1 : int64_t(x >> 33) % v);
}

void accepted_cases() {
  const int32_t tokens[] = {7, 1, 2, 3};
  const int32_t all_right[] = {1, 2, 3, 9}, first_wrong[] = {4, 2, 3, 9}, last_wrong[] = {1, 2, 5, 9};
  EXPECT(mkc::accepted_drafts(tokens, all_right, 4) == 3, "all drafts stand");
  EXPECT(mkc::accepted_drafts(tokens, first_wrong, 4) == 0, "the first draft falls, and the rest with it");
  EXPECT(mkc::accepted_drafts(tokens, last_wrong, 4) == 2, "two stand");
  EXPECT(mkc::accepted_drafts(tokens, all_right, 1) == 0, "a step of one token has no drafts");
  const int32_t later_right[] = {4, 2, 3, 9};  // drafts 2 and 3 match, but draft 1 does not
  EXPECT(mkc::accepted_drafts(tokens, later_right, 4) == 0, "a draft after a fallen one never stands");
}

void drafter_cases(std::mt19937& rng) {
  // transformers' example shape: the last 2 tokens recur at 0.
  const Tokens h = {1, 2, 3, 4, 1, 2};
  int32_t out[8];
  uint32_t n = mkc::ngram_draft(h.data(), uint32_t(h.size()), 1, 2, 3, out);
  EXPECT(n == 3 && out[0] == 3 && out[1] == 4 && out[2] == 1, "[1 2 3 4 1 2]: drafts 3 4 1 (got %u)", n);
  const Tokens none = {1, 2, 3, 4};
  EXPECT(mkc::ngram_draft(none.data(), 4, 1, 3, 4, out) == 0, "no recurring n-gram, no drafts");
  EXPECT(mkc::ngram_draft(none.data(), 1, 1, 3, 4, out) == 0, "a history of one token");
  uint64_t cases = 0, drafted = 0;
  for (int round = 0; round < 4000; ++round) {
    std::uniform_int_distribution<int32_t> tok(0, 1 + round % 6);
    const uint32_t len = 1 + round % 40, min_n = 1 + round % 2, max_n = 1 + round % 4, max_draft = round % 9;
    Tokens hist(len);
    for (auto& t : hist) t = tok(rng);
    const Tokens want = reference_draft(hist, min_n, max_n, max_draft);
    int32_t got[16];
    const uint32_t count = mkc::ngram_draft(hist.data(), len, min_n, max_n, max_draft, got);
    EXPECT(count == want.size() && std::equal(want.begin(), want.end(), got), "round %d: %u drafts, want %zu", round,
           count, want.size());
    ++cases;
    drafted += count > 0;
  }
  std::printf("ngram_draft: %llu random histories, %llu with drafts\n", (unsigned long long)cases,
              (unsigned long long)drafted);
}

// Decodes `steps` tokens after `prompt` with verify steps of t tokens, drafts
// from `draft` (the sequence so far, how many wanted); returns the tokens and
// how many steps it took.
template <class Draft>
Tokens speculative(const Tokens& prompt, uint32_t steps, uint32_t t, int32_t v, Draft draft, uint32_t& verify_steps) {
  Tokens seq = prompt;
  verify_steps = 0;
  while (seq.size() < prompt.size() + steps) {
    Tokens tokens = {seq.back()};
    for (int32_t d : draft(seq, t - 1)) tokens.push_back(d);
    tokens.resize(t, 0);  // a short draft is padded; the padding is a draft like any other
    // The megakernel's argmax at each of the t positions: causal, each after its own prefix.
    Tokens argmax(t), prefix = seq;
    for (uint32_t i = 0; i < t; ++i) {
      if (i > 0) prefix.push_back(tokens[i]);
      argmax[i] = toy_argmax(prefix, v);
    }
    const uint32_t a = mkc::accepted_drafts(tokens.data(), argmax.data(), t);
    for (uint32_t i = 1; i <= a; ++i) seq.push_back(tokens[i]);
    seq.push_back(argmax[a]);
    ++verify_steps;
  }
  seq.resize(prompt.size() + steps);
  return Tokens(seq.begin() + long(prompt.size()), seq.end());
}

void equals_greedy(std::mt19937& rng) {
  const int32_t v = 50;
  const uint32_t steps = 256;
  uint64_t greedy_steps = 0, lookup_steps = 0;
  for (int seed = 0; seed < 3; ++seed) {
    Tokens prompt(12);
    for (auto& x : prompt) x = std::uniform_int_distribution<int32_t>(0, v - 1)(rng);
    Tokens greedy, seq = prompt;
    for (uint32_t i = 0; i < steps; ++i) greedy.push_back(seq.emplace_back(toy_argmax(seq, v)));
    greedy_steps += steps;
    for (uint32_t t : {1u, 2u, 4u, 8u}) {
      uint32_t n = 0;
      auto lookup = [](const Tokens& s, uint32_t want) {
        int32_t out[16];
        const uint32_t c = mkc::ngram_draft(s.data(), uint32_t(s.size()), 1, 3, want, out);
        return Tokens(out, out + c);
      };
      EXPECT(speculative(prompt, steps, t, v, lookup, n) == greedy, "seed %d, T %u: prompt lookup", seed, t);
      if (t == 4) lookup_steps += n;
      auto random = [&](const Tokens&, uint32_t want) {
        Tokens d(want);
        for (auto& x : d) x = std::uniform_int_distribution<int32_t>(0, v - 1)(rng);
        return d;
      };
      EXPECT(speculative(prompt, steps, t, v, random, n) == greedy, "seed %d, T %u: random drafts", seed, t);
      auto wrong = [&](const Tokens& s, uint32_t want) {  // never the greedy token
        Tokens d, p = s;
        for (uint32_t i = 0; i < want; ++i) d.push_back(p.emplace_back((toy_argmax(p, v) + 1) % v));
        return d;
      };
      EXPECT(speculative(prompt, steps, t, v, wrong, n) == greedy && n == steps, "seed %d, T %u: all wrong", seed, t);
      auto right = [&](const Tokens& s, uint32_t want) {  // the greedy tokens themselves
        Tokens d, p = s;
        for (uint32_t i = 0; i < want; ++i) d.push_back(p.emplace_back(toy_argmax(p, v)));
        return d;
      };
      EXPECT(speculative(prompt, steps, t, v, right, n) == greedy && n == (steps + t - 1) / t,
             "seed %d, T %u: all right in %u steps", seed, t, n);
    }
  }
  std::printf("speculative decoding equals greedy: prompt lookup at T 4 took %llu verify steps for %llu tokens\n",
              (unsigned long long)lookup_steps, (unsigned long long)greedy_steps);
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  accepted_cases();
  drafter_cases(rng);
  equals_greedy(rng);
  return report();
}
