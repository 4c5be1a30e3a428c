/* fuzz_util.h — what the libFuzzer targets share: the readers under test take a path, so each
 * input is written to one scratch file in /dev/shm (a RAM file system: no disk I/O per run),
 * rewritten in place for every input. Header-only; each target is its own executable. */
#ifndef COLIBRI_FUZZ_UTIL_H
#define COLIBRI_FUZZ_UTIL_H

#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A per-process scratch path "<dir>/colibri-fuzz-<pid>-<tag>" (dir: /dev/shm, else /tmp). */
__attribute__((unused)) static const char *fuzz_path(char *buf, size_t cap, const char *tag) {
    const char *dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(buf, cap, "%s/colibri-fuzz-%d-%s", dir, (int)getpid(), tag);
    return buf;
}

/* Replace the file's contents with data[0..n). A harness failure (not a finding) aborts. */
__attribute__((unused)) static void fuzz_write(const char *path, const uint8_t *data, size_t n) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        perror(path);
        abort();
    }
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(fd, data + done, n - done);
        if (w <= 0) {
            perror(path);
            abort();
        }
        done += (size_t)w;
    }
    close(fd);
}

#endif
