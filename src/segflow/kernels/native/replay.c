/* segflow native kernels: a replayed run of libdnnl primitives in one call.
 *
 * segflow_replay_executes executes recorded oneDNN primitives in order
 * (kernels/onednn/replay.py). Per step it re-points the source, destination and
 * residual memories that point elsewhere (the step's `handles` array, shared
 * with kernels/onednn/, says where each points now), then executes.
 * libdnnl's entry points arrive as function pointers: this file needs no oneDNN
 * headers and links against nothing.
 *
 * It exists because the same loop in Python pays the interpreter at every step,
 * several times more right after a kernel has flushed the caches than warm, and a
 * run has one step per primitive: for a small convolutional model that is a visible
 * share of the run (figures: docs/performance.md, 'Why each kernel exists').
 *
 * segflow_replay_calls does the same for segflow's own kernels (kernels/replay.py):
 * each step is a kernel entry point that takes one argument structure (a linear's
 * segflow_linear_t, an add + layer norm's, an attention's segflow_attention_call_t),
 * recorded with its tensors' addresses.
 */
#include <stddef.h>
#include <stdint.h>

typedef int (*segflow_execute_fn)(void *primitive, void *stream, int nargs, const void *args);
typedef int (*segflow_set_handle_fn)(void *memory, void *handle);

/* One recorded execute; the layout kernels/onednn/replay.py's ctypes structure mirrors. */
typedef struct {
    void *primitive;
    void *stream;
    const void *args;        /* dnnl_exec_arg_t[nargs] */
    int64_t nargs;
    void *memory[3];         /* source, destination, residual (NULL: none) */
    uintptr_t *handles;      /* where those memories point now: uintptr_t[3] */
    const uintptr_t *address; /* where this step wants them: uintptr_t[3] (0: no residual) */
    segflow_execute_fn run;   /* what executes `primitive` (NULL: libdnnl's execute), such
                               * as winograd.c's segflow_winograd_execute for its plan */
} segflow_execute_t;

/* Runs steps[0..n); returns n, or the index of the step whose call failed with its
 * oneDNN status in *status. */
int64_t segflow_replay_executes(const segflow_execute_t *steps, int64_t n,
                                segflow_execute_fn execute, segflow_set_handle_fn set_handle,
                                int *status) {
    for (int64_t i = 0; i < n; i++) {
        const segflow_execute_t *s = &steps[i];
        for (int k = 0; k < 3; k++) {
            if (s->memory[k] != NULL && s->address[k] != 0 && s->handles[k] != s->address[k]) {
                int failed = set_handle(s->memory[k], (void *)s->address[k]);
                if (failed) {
                    *status = failed;
                    return i;
                }
                s->handles[k] = s->address[k];
            }
        }
        int failed = (s->run ? s->run : execute)(s->primitive, s->stream, (int)s->nargs,
                                                  s->args);
        if (failed) {
            *status = failed;
            return i;
        }
    }
    return n;
}

/* One recorded call of a segflow kernel: fn(args), 0 on success. */
typedef struct {
    int (*fn)(void *args);
    void *args;
} segflow_call_t;

/* Runs calls[0..n) in order; returns n, or the index of the call that failed with its
 * status in *status. */
int64_t segflow_replay_calls(const segflow_call_t *calls, int64_t n, int *status) {
    for (int64_t i = 0; i < n; i++) {
        int failed = calls[i].fn(calls[i].args);
        if (failed) {
            *status = failed;
            return i;
        }
    }
    return n;
}

/* A segflow kernel call as a step of segflow_replay_executes (`primitive` a
 * segflow_call_t, its memories NULL): the classifier's linear after a replayed run of
 * primitives (kernels/onednn/replay.py) runs inside that run's one C call. */
int segflow_call_execute(void *call, void *stream, int nargs, const void *args) {
    (void)stream, (void)nargs, (void)args;
    const segflow_call_t *c = call;
    return c->fn(c->args);
}
