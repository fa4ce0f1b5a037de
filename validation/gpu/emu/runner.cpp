// The emulator's launch: every block of the grid in turn; each CUDA thread of a block is a fiber
// with its own stack, switched by a few instructions of assembly (x86-64 System V).
#include <sys/mman.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "emu.h"

dim3e threadIdx, blockIdx, blockDim, gridDim;
unsigned char* emu_dyn;

typedef void (*Tramp)(const unsigned long long*);
Tramp emu_find(const char* name);  // generated

// emu_switch(save, load): saves the callee-saved registers and the stack pointer to *save,
// continues on the stack `load`.
extern "C" void emu_switch(void** save, void* load);
asm(R"(
.text
.globl emu_switch
.type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size emu_switch, .-emu_switch
)");

namespace {

const size_t STACK = 256 * 1024;

struct Fiber {
    void* sp;
    unsigned char* stack;
    bool done;
    bool waiting;  // in a barrier
};

struct Group {  // a block or a warp: barrier state
    unsigned live, arrived;
    unsigned long long gen;
};

struct Block {
    std::vector<Fiber> f;
    std::vector<Group> warps;
    Group block;
    std::vector<float> xchg;
    unsigned cur;
    void* sched_sp;
    Tramp fn;
    const unsigned long long* args;
    dim3e dim;
};

Block B;

void set_thread(unsigned t) {
    threadIdx = {t % B.dim.x, (t / B.dim.x) % B.dim.y, t / (B.dim.x * B.dim.y)};
}

void yield() { emu_switch(&B.f[B.cur].sp, B.sched_sp); set_thread(B.cur); }

void barrier(Group& g) {
    const unsigned long long gen = g.gen;
    if (++g.arrived == g.live) {
        g.arrived = 0;
        g.gen++;
        return;
    }
    B.f[B.cur].waiting = true;
    while (g.gen == gen) yield();
    B.f[B.cur].waiting = false;
}

void leave(Group& g) {  // an exited thread no longer takes part in the group's barriers
    g.live--;
    if (g.arrived > 0 && g.arrived == g.live) {
        g.arrived = 0;
        g.gen++;
    }
}

void fiber_main() {
    const unsigned me = B.cur;
    B.fn(B.args);
    leave(B.warps[me / 32]);
    leave(B.block);
    B.f[me].done = true;
    emu_switch(&B.f[me].sp, B.sched_sp);
    abort();  // never resumed
}

std::vector<unsigned char*> stacks;

unsigned char* stack_for(unsigned i) {
    while (stacks.size() <= i) {
        void* m = mmap(nullptr, STACK, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) abort();
        stacks.push_back(static_cast<unsigned char*>(m));
    }
    return stacks[i];
}

}  // namespace

void emu_block_barrier() { barrier(B.block); }
void emu_warp_barrier() { barrier(B.warps[B.cur / 32]); }
float* emu_warp_buf() { return B.xchg.data() + 32 * (B.cur / 32); }
int emu_lane() { return (int)(B.cur & 31); }

extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                          unsigned by, unsigned bz, unsigned smem, const unsigned long long* args,
                          int nargs) {
    (void)nargs;
    static std::mutex one;  // one launch at a time
    std::lock_guard<std::mutex> g(one);
    Tramp f = emu_find(name);
    if (f == nullptr) return 1;
    const unsigned nt = bx * by * bz;
    if (nt == 0 || nt > 1024) return 2;
    const unsigned nwarps = (nt + 31) / 32;
    std::vector<unsigned char> dyn(smem + 64);
    emu_dyn = dyn.data() + ((16 - ((uintptr_t)dyn.data() & 15)) & 15);
    B.fn = f;
    B.args = args;
    B.dim = {bx, by, bz};
    B.xchg.assign(32 * nwarps, 0.0f);
    B.f.assign(nt, Fiber{});
    B.warps.assign(nwarps, Group{});
    blockDim = {bx, by, bz};
    gridDim = {gx, gy, gz};
    for (unsigned z = 0; z < gz; z++)
        for (unsigned y = 0; y < gy; y++)
            for (unsigned x = 0; x < gx; x++) {
                blockIdx = {x, y, z};
                memset(dyn.data(), 0xA5, dyn.size());  // poisoned: a read before a write shows
                B.block = Group{nt, 0, 0};
                for (unsigned w = 0; w < nwarps; w++) {
                    B.warps[w] = Group{(w + 1) * 32 <= nt ? 32 : nt - w * 32, 0, 0};
                }
                for (unsigned t = 0; t < nt; t++) {
                    Fiber& fb = B.f[t];
                    fb.stack = stack_for(t);
                    fb.done = false;
                    fb.waiting = false;
                    // an initial frame that emu_switch "returns" from into fiber_main
                    uintptr_t top = ((uintptr_t)fb.stack + STACK) & ~(uintptr_t)15;
                    void** sp = reinterpret_cast<void**>(top);
                    *--sp = nullptr;                               // fiber_main's return slot
                    *--sp = reinterpret_cast<void*>(&fiber_main);  // emu_switch's ret
                    for (int r = 0; r < 6; r++) *--sp = nullptr;   // rbp rbx r12..r15
                    fb.sp = sp;
                }
                unsigned live = nt;
                unsigned long long spins = 0;
                while (live > 0) {
                    bool progressed = false;
                    for (unsigned t = 0; t < nt; t++) {
                        if (B.f[t].done) continue;
                        B.cur = t;
                        set_thread(t);
                        const bool was_waiting = B.f[t].waiting;
                        emu_switch(&B.sched_sp, B.f[t].sp);
                        if (B.f[t].done) {
                            live--;
                            progressed = true;
                        } else if (!was_waiting || !B.f[t].waiting) {
                            progressed = true;
                        }
                    }
                    if (!progressed && ++spins > 1000000) {
                        fprintf(stderr, "emu: %s block (%u,%u,%u): deadlock in a barrier\n", name,
                                x, y, z);
                        abort();
                    }
                }
            }
    return 0;
}
