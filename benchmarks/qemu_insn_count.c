/* qemu_insn_count.c — a QEMU TCG plugin that counts the guest instructions a program executes
 * (user-mode emulation), for benchmarks/neon_insn_ratio.py. Each translated block adds its
 * instruction count to one counter every time it runs (an inline add, so counting costs
 * little); at exit the total is printed as "insns N" on QEMU's plugin output (stderr).
 *
 * Built for the host: cc -shared -fPIC -O2 -o qemu_insn_count.so qemu_insn_count.c
 * Run:                qemu-aarch64 -plugin ./qemu_insn_count.so -L SYSROOT PROGRAM ...
 *
 * The handful of plugin API entry points used are declared here from QEMU's documented plugin
 * interface (version 1, QEMU 6.x-7.x user mode), so no QEMU headers are needed. */
#include <inttypes.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef uint64_t qemu_plugin_id_t;
struct qemu_plugin_tb;
typedef struct qemu_info_t qemu_info_t; /* not read */
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 = 0 };

void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id,
                                           void (*cb)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb));
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op, void *ptr,
                                              uint64_t imm);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, void (*cb)(qemu_plugin_id_t id, void *userdata),
                                    void *userdata);
void qemu_plugin_outs(const char *string);

__attribute__((visibility("default"))) int qemu_plugin_version = 1;

/* every vCPU adds into it: the programs measured run their kernels on one thread */
static uint64_t g_insns;

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb) {
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &g_insns, qemu_plugin_tb_n_insns(tb));
}

static void on_exit(qemu_plugin_id_t id, void *userdata) {
    char line[64];
    snprintf(line, sizeof line, "insns %" PRIu64 "\n", g_insns);
    qemu_plugin_outs(line);
}

__attribute__((visibility("default"))) int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info,
                                                               int argc, char **argv) {
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_atexit_cb(id, on_exit, NULL);
    return 0;
}
