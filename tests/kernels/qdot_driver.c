/* Runs the qdot kernel on cases read from stdin, for tests of builds this machine cannot load
 * (another CPU architecture, under an emulator: tests/test_cpu_qdot_cross.py).
 *
 * Each case: int32 ggml_type, threads; int64 N, K, T, weight bytes; the packed weights; x as
 * T * K float32. Answer on stdout: int32 status, then y as T * N float32. The first line of
 * stderr names the build's instruction set (qdot_isa). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int qdot_linear(int, const uint8_t *, int64_t, int64_t, int64_t, const float *, float *, int);
int qdot_isa(void);

static int read_all(void *p, size_t n) { return fread(p, 1, n, stdin) == n; }

int main(void) {
    fprintf(stderr, "isa %d\n", qdot_isa());
    int32_t head[2];
    int64_t dims[4];
    while (read_all(head, sizeof head) && read_all(dims, sizeof dims)) {
        const int64_t N = dims[0], K = dims[1], T = dims[2], wbytes = dims[3];
        uint8_t *w = malloc((size_t)wbytes);
        float *x = malloc(sizeof(float) * (size_t)(T * K)), *y = malloc(sizeof(float) * (size_t)(T * N));
        if (!w || !x || !y || !read_all(w, (size_t)wbytes) || !read_all(x, sizeof(float) * (size_t)(T * K)))
            return 2;
        const int32_t rc = qdot_linear(head[0], w, N, K, T, x, y, head[1]);
        fwrite(&rc, sizeof rc, 1, stdout);
        fwrite(y, sizeof(float), (size_t)(T * N), stdout);
        fflush(stdout);
        free(w), free(x), free(y);
    }
    return 0;
}
