/* Decodes that share a prompt prefix, planned into one attention item each group (attend_dpbf16_cols_shared).
 *
 * A decode's attention reads its whole context from the KV cache: 1200 cached tokens are ~0.9 MB a layer for
 * SmolLM2, from DRAM once the batch's caches outgrow the CPU's. Requests that share a system prompt or a
 * document get the same physical blocks from the prefix cache, and each decode read them again. Here decodes
 * whose block tables begin alike are one item: the chunks of keys they share are read and laid out once and run
 * for every member's rows. A row's bits do not depend on it (paged_attention_dpbf16.h). Where generated rows take
 * AMX tiles (paged_attention_amx_rows.h) there are no cols items, so no groups.
 *
 * Sorting the candidates by their block tables makes any run of them share what its weakest neighbouring pair
 * shares. A run is one group when that is at least a whole chunk (DKC keys) and at least half of what its
 * strongest pair shares (so a short common system prompt does not pull apart pairs that share far more), and it
 * has at most `cap` members (so that the groups still spread over the threads); else it is split at its weakest
 * link, the one nearest its middle among equals, and each side is looked at again. Those left alone are sorted
 * sequences still, without the groups between them: a next round groups them among themselves (two that share
 * a short prefix, once the cluster that shares a long one is out from between them).
 *
 * Part of paged_attention.c's translation unit (included after the item planning it uses).
 */
#ifndef UCM_PAGED_ATTENTION_SHARED_H
#define UCM_PAGED_ATTENTION_SHARED_H

#ifdef UCM_HAS_DPBF16
#define SHARED_MAX 32 /* members of one item at most: their rows' state stays in L2 (~7 KB each for SmolLM2) */

/* Whether sequence seq's attention is one all-heads decode item of the cols body (its rows' only item) that could
 * share a whole chunk with another's. */
static inline int shared_candidate(const Problem *p, int32_t seq, int32_t dtype) {
    return dtype == UCM_DTYPE_BF16 && !skipped(p, seq) && dpbf16_take(p, seq, dtype) &&
           amx_queries(p, seq, dtype) == 0 && dpbf16_all_heads(p, num_queries(p, seq)) && p->seq_lens[seq] >= DKC;
}

static inline int32_t blocks_of(const Problem *p, int32_t seq) {
    return (p->seq_lens[seq] + p->block_size - 1) / p->block_size;
}

/* Keys whose chunks sequences a and b may run together: their common leading blocks, within both lengths (every
 * row attends its chunk whole up to there), in whole chunks. */
static inline int32_t shared_keys(const Problem *p, int32_t a, int32_t b) {
    const int32_t *ta = table_of(p, a), *tb = table_of(p, b);
    const int32_t na = blocks_of(p, a), nb = blocks_of(p, b), n = na < nb ? na : nb;
    int32_t k = 0;
    while (k < n && ta[k] == tb[k]) k++;
    int32_t keys = k * p->block_size;
    if (keys > p->seq_lens[a]) keys = p->seq_lens[a];
    if (keys > p->seq_lens[b]) keys = p->seq_lens[b];
    return keys / DKC * DKC;
}

/* Block tables in lexicographic order (then sequence ids), for qsort_r. */
static int table_order(const void *x, const void *y, void *problem) {
    const Problem *p = problem;
    const int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    const int32_t *ta = table_of(p, a), *tb = table_of(p, b);
    const int32_t na = blocks_of(p, a), nb = blocks_of(p, b), n = na < nb ? na : nb;
    for (int32_t k = 0; k < n; k++)
        if (ta[k] != tb[k]) return ta[k] < tb[k] ? -1 : 1;
    return na != nb ? (na < nb ? -1 : 1) : (a > b) - (a < b);
}

/* A plan in the making: the candidates of this round in table order and their links (link[k] = shared_keys of
 * seqs[k] and seqs[k + 1]); the groups so far as Items over `members`. */
typedef struct {
    int32_t *seqs, *link, *members;
    int32_t cap, used;
    int64_t groups;
    Item *out;
    uint8_t *grouped;
} SharedPlan;

/* The groups within seqs[i .. j). */
static void split_groups(SharedPlan *s, int32_t i, int32_t j) {
    if (j - i < 2) return;
    int32_t weak = i, lo = s->link[i], hi = s->link[i];
    for (int32_t k = i + 1; k < j - 1; k++) {
        const int32_t off = 2 * k + 2 - i - j, best = 2 * weak + 2 - i - j; /* twice the distance from the middle */
        if (s->link[k] < lo || (s->link[k] == lo && abs(off) < abs(best))) lo = s->link[k], weak = k;
        if (s->link[k] > hi) hi = s->link[k];
    }
    if (lo >= DKC && 2 * lo >= hi && j - i <= s->cap) {
        s->out[s->groups++] = (Item){.seq = s->seqs[i], .group_at = s->used, .group_len = j - i, .group_keys = lo};
        for (int32_t m = i; m < j; m++) s->grouped[s->seqs[m]] = 1, s->members[s->used++] = s->seqs[m];
        return;
    }
    split_groups(s, i, weak + 1);
    split_groups(s, weak + 1, j);
}

/* The groups of this call, as Items (group_len > 0) in out[0 ..]; returns how many (at most num_seqs / 2).
 * other_items: the call's items that are not candidates' (a prompt's rows, say). *members (to free; NULL with no
 * group) lists each group's members together; grouped[seq] = 1 for a member, whose own item the caller leaves
 * out. Without memory, no groups. */
static int64_t plan_shared(const Problem *p, int32_t dtype, int32_t num_seqs, int64_t other_items, int32_t num_threads,
                           int32_t **members, uint8_t *grouped, Item *out) {
    *members = NULL;
    const int32_t threads = num_threads > 1 ? num_threads : 1;
    int32_t n = 0;
    for (int32_t b = 0; b < num_seqs; b++) n += shared_candidate(p, b, dtype);
    /* Decodes alone and too few to make a group of two for every thread: a group would leave a thread idle
     * (2 decodes sharing 1024 of 1200 keys, 2 threads: 1.37-1.50x the time as one item). */
    if (n < 2 || (other_items < threads && n < 2 * threads)) return 0;
    int32_t *mem = malloc((size_t)n * 3 * sizeof *mem);
    if (mem == NULL) return 0;
    /* Beside other items (a prompt's), the threads have those to share: groups as large as they come. Decodes
     * alone: at least two groups a thread, each as large as that leaves. */
    int32_t cap = other_items >= 2 * threads ? SHARED_MAX : (n + 2 * threads - 1) / (2 * threads);
    cap = cap < 2 ? 2 : cap > SHARED_MAX ? SHARED_MAX : cap;
    SharedPlan s = {.seqs = mem + n, .link = mem + 2 * n, .members = mem, .cap = cap, .out = out, .grouped = grouped};
    n = 0;
    for (int32_t b = 0; b < num_seqs; b++)
        if (shared_candidate(p, b, dtype)) s.seqs[n++] = b;
    qsort_r(s.seqs, (size_t)n, sizeof *s.seqs, table_order, (void *)p);
    for (int64_t before = -1; s.groups != before && n >= 2;) { /* rounds, until one adds no group */
        before = s.groups;
        for (int32_t k = 0; k + 1 < n; k++) s.link[k] = shared_keys(p, s.seqs[k], s.seqs[k + 1]);
        split_groups(&s, 0, n);
        int32_t rest = 0; /* the next round's: those still alone, in their order */
        for (int32_t k = 0; k < n; k++)
            if (!grouped[s.seqs[k]]) s.seqs[rest++] = s.seqs[k];
        n = rest;
    }
    *members = mem;
    return s.groups;
}
#endif

#endif /* UCM_PAGED_ATTENTION_SHARED_H */
