"""Accuracy harness: what each KV-cache method does to a real model's answers on real text.

Every method runs through the same engine on the same prompts with the same greedy decoding, on
SmolLM2-135M-Instruct (the paper's Table 1 and Fig. 5, issue 5):

``needle``  A fact ("The secret code of the amber lighthouse is 48213.") inserted at depths
            10%..90% of a long real haystack (the KJV, or Shakespeare and Milton) of about 2k, 4k
            and 7k tokens, asked after the haystack through the chat template. Score: exact match
            of the first number in the greedy answer.
``ppl``     Decode perplexity: the first 3k tokens of a real document are prefilled through the
            compressed cache, then the next 256 are teacher-forced through the decode step, so
            ring appends and flushes are exercised. Score: perplexity, and its ratio to the full
            cache's on the same documents.
``code``    Like LongBench's LCC: 3k tokens of a standard-library file, then the next line,
            greedily. Score: edit similarity to the true line.

Parts (each writes ``<part>.json`` and ``<part>.md`` into ``--out`` after every unit of work, so
a run that is killed keeps what it measured; ``accuracy.png`` is drawn from whatever JSON is there)::

    python -m minikv_compile.perf.accuracy                 # main table: the paper's methods + ours
    python -m minikv_compile.perf.accuracy --sweep         # MiniKV budgets x bits: the bytes curve
    python -m minikv_compile.perf.accuracy --quick         # CPU, minutes: end to end + HF check
    python -m minikv_compile.perf.accuracy --quick --model tiny   # plumbing only, no download
    python -m minikv_compile.perf.accuracy --agreement     # GPU (compiled engine) against CPU
    python -m minikv_compile.perf.accuracy --plot-only     # redraw the PNG from the JSON files
    python -m minikv_compile.perf.accuracy --extend ...    # go on from --out's JSON: the units
                                                           # it holds are kept, the rest run

``--mode context-first`` (or ``both``, paired on the same samples and engine): each prompt's
document is compressed by ``cache_prompt`` before any question exists, then the prompt runs
through that cache, its tail prefilled and kept whole, as a cached context is used. The split:
needle, the chat prefix and the haystack, then the question and the assistant's header;
perplexity and code, the prompt but its last ``tasks.CONTEXT_TAIL`` (32) tokens, the window that
SnapKV's ranking reads in question-last mode, so the scored continuation comes after a tail that
selection never saw. KV bytes: the compressed document plus the tail and the generated tokens.
Methods a prompt cache cannot serve (tensor parallel) are listed as not run in that mode.

Samples are fixed: every prompt comes from a string-seeded ``random.Random`` over fixed texts,
and each task's token ids are fingerprinted in the JSON (code samples depend on the Python
version's standard library; paths, line numbers and file hashes are recorded). Uncertainty: 95%
Wilson intervals for needle accuracy, paired bootstrap intervals (over samples, against the full
cache) for every ratio; every per-sample result is in the JSON.

On CUDA the engine runs with ``compile=False, cuda_graphs=True`` by default: the decode step is
captured eagerly into a CUDA graph. Same kernels as the compiled engine, one capture (well under
a second) instead of a compile per configuration and decode mode (the demo's SmolLM2 engine build
took 19-23 s on an H200; the main table has 19 configurations x 2 modes, the sweep 29 x 2), and a
replay has no per-op launch overhead from Python. ``--compile`` traces the step as well, and
``--agreement`` checks the compiled engine against the CPU engine on the quick samples.

Modules, one job each: ``tasks`` (plans, real-text corpora, the samples and their scores),
``methods`` (the compared caches and their KV bytes), ``stats`` (intervals, paired tests, the
summary of a run), ``running`` (the engine and HF over the samples, the run, the agreement
check), ``reporting`` (JSON, markdown, the plot), ``__main__`` (the command line).
"""
