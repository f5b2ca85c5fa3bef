/* Print the native stack on SIGSEGV/SIGABRT, then die as before: preloaded into a process
 * (LD_PRELOAD) whose crash Python's faulthandler can only place at a Python line. */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_fault(int sig) {
    void *frames[64];
    int n = backtrace(frames, 64);
    const char msg[] = "\n--- native stack (segv_trace) ---\n";
    write(2, msg, sizeof msg - 1);
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    signal(SIGSEGV, on_fault);
    signal(SIGBUS, on_fault);
}
