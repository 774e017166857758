/*
 * A stand-in libnvidia-ml.so.1 for topoagent's test suite: test-only, never shipped.
 *
 * The real nvidia-ml-py (pynvml) loads it with CDLL("libnvidia-ml.so.1") and calls it as it
 * calls the driver's library, so the agent's NVML code is tested through the binding's real
 * signatures, struct layouts and byref conventions.  It answers from a flat "node file"
 * (one `key value` a line) written by tests/nvml_stub.py from a recording; the keys are
 * listed in KEYS below and documented in tests/nvml_stub.py.
 *
 * Compiled against NVIDIA's own nvml.h from the nvidia-nvml-dev wheel (NVIDIA's header,
 * under the licence shipped in that wheel), so every struct is laid out as the driver's is.
 *
 * Environment, read when nvmlInit takes the reference count from 0 to 1:
 *   TOPOAGENT_NVML_STUB_NODE    the node file; re-read whenever its inode, size or mtime change
 *                               (checked in nvmlDeviceGetCount_v2 and nvmlDeviceGetHandleByIndex_v2)
 *   TOPOAGENT_NVML_STUB_EVENTS  an append-only file of "<gpu index> <xid>" lines: Xid events
 *
 * Everything is bounded (file size, line length, GPUs, links); a malformed node file makes
 * init fail with NVML_ERROR_UNKNOWN and one line on stderr.  One mutex guards all state.
 */
#define NVML_NO_UNVERSIONED_FUNC_DEFS /* we define the _v2/_v3 names the binding asks for */
#include <nvml.h>

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

#define MAX_GPUS 64
#define MAX_LINKS NVML_NVLINK_MAX_LINKS /* 36 in the header we build against */
#define MAX_FILE_BYTES (1 << 20)
#define MAX_LINE 512
#define MAX_ENTRIES 16384
#define MAX_KEY 128
#define MAX_VALUE 128
#define MAX_PROCESSES 256
#define MAX_AFFINITY_WORDS 64
#define MAX_EVENT_SETS 16
#define MAX_EVENT_LINE 64
#define XID_EVENT nvmlEventTypeXidCriticalError

/* --- the node file ---------------------------------------------------------------------- */

enum kind { TEXT, UNSIGNED, SIGNED };

/* Every key the node file may hold: '#' stands for a decimal number, '*' for a C name. */
static const struct { const char *pattern; enum kind kind; } KEYS[] = {
    {"driver_version", TEXT},
    {"nvml_version", TEXT},
    {"cuda_driver_version", SIGNED},
    {"gpu_count", UNSIGNED},
    {"gpu.#.uuid", TEXT},
    {"gpu.#.name", TEXT},
    {"gpu.#.pci.bus_id", TEXT},
    {"gpu.#.pci.device_id", UNSIGNED},
    {"gpu.#.pci.subsystem_id", UNSIGNED},
    {"gpu.#.memory.total", UNSIGNED},
    {"gpu.#.memory.free", UNSIGNED},
    {"gpu.#.memory.used", UNSIGNED},
    {"gpu.#.memory.reserved", UNSIGNED},
    {"gpu.#.numa_node", UNSIGNED},
    {"gpu.#.cpu_affinity.#", UNSIGNED},
    {"gpu.#.nvlink.#.state", UNSIGNED},
    {"gpu.#.nvlink.#.version", UNSIGNED},
    {"gpu.#.nvlink.#.remote_bus_id", TEXT},
    {"gpu.#.nvlink.#.remote_type", UNSIGNED},
    {"gpu.#.nvlink.#.error.#", UNSIGNED},
    {"gpu.#.p2p.#.#", UNSIGNED},
    {"gpu.#.ecc.#.#", UNSIGNED},
    {"gpu.#.power_mw", UNSIGNED},
    {"gpu.#.power_limit_mw", UNSIGNED},
    {"gpu.#.energy_mj", UNSIGNED},
    {"gpu.#.utilization.gpu", UNSIGNED},
    {"gpu.#.utilization.memory", UNSIGNED},
    {"gpu.#.utilization.encoder", UNSIGNED},
    {"gpu.#.utilization.decoder", UNSIGNED},
    {"gpu.#.process_count", UNSIGNED},
    {"gpu.#.process.#.pid", UNSIGNED},
    {"gpu.#.process.#.used_memory", UNSIGNED},
    {"gpu.#.fabric.cluster_uuid", TEXT},
    {"gpu.#.fabric.clique_id", UNSIGNED},
    {"gpu.#.fabric.state", UNSIGNED},
    {"gpu.#.fabric.status", UNSIGNED},
    {"gpu.#.fabric.health_mask", UNSIGNED},
    {"gpu.#.fabric.health_summary", UNSIGNED},
    {"gpu.#.temperature.#", UNSIGNED},
    {"gpu.#.field.#.#", UNSIGNED},
    {"gpu.#.clock.#", UNSIGNED},
    {"gpu.#.clocks_event_reasons", UNSIGNED},
    {"gpu.#.remapped_rows.correctable", UNSIGNED},
    {"gpu.#.remapped_rows.uncorrectable", UNSIGNED},
    {"gpu.#.remapped_rows.pending", UNSIGNED},
    {"gpu.#.remapped_rows.failure", UNSIGNED},
    {"gpu.#.retired_pages_pending", UNSIGNED},
    {"error.*", SIGNED},
    {"error.*.#", SIGNED},
};

struct entry {
    char key[MAX_KEY];
    char text[MAX_VALUE];
    unsigned long long number; /* UNSIGNED, or SIGNED stored two's complement */
};

struct node {
    struct entry *entries; /* sorted by key */
    size_t count;
    unsigned gpu_count;
};

struct nvmlDevice_st { unsigned index; };
struct nvmlEventSet_st {
    int in_use;
    unsigned long long registered[MAX_GPUS]; /* event types per GPU */
    long offset;                             /* how far this set has read the events file */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned refcount;
static struct node node;
static char node_path[4096], events_path[4096];
static struct stat node_seen;
static struct nvmlDevice_st devices[MAX_GPUS];
static struct nvmlEventSet_st event_sets[MAX_EVENT_SETS];

static void say(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("nvml stub: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* Does key match pattern?  '#' takes 1-9 digits; '*' takes a C identifier. */
static int matches(const char *pattern, const char *key) {
    while (*pattern) {
        if (*pattern == '#') {
            int n = 0;
            while (isdigit((unsigned char)*key) && n < 10) key++, n++;
            if (n == 0 || n > 9) return 0;
            pattern++;
        } else if (*pattern == '*') {
            int n = 0;
            while ((isalnum((unsigned char)*key) || *key == '_') && n < 100) key++, n++;
            if (n == 0 || n >= 100) return 0;
            pattern++;
        } else if (*pattern++ != *key++) {
            return 0;
        }
    }
    return *key == '\0';
}

static int parse_number(const char *text, enum kind kind, unsigned long long *out) {
    char *end;
    errno = 0;
    if (kind == UNSIGNED) {
        if (text[0] == '-') return 0;
        *out = strtoull(text, &end, 0);
    } else {
        *out = (unsigned long long)strtoll(text, &end, 0);
    }
    return errno == 0 && end != text && *end == '\0';
}

static int by_key(const void *a, const void *b) {
    return strcmp(((const struct entry *)a)->key, ((const struct entry *)b)->key);
}

/* The entry for key, or NULL. */
static const struct entry *find(const char *fmt, ...) {
    struct entry probe;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(probe.key, sizeof probe.key, fmt, ap);
    va_end(ap);
    if (n < 0 || n >= (int)sizeof probe.key || node.count == 0) return NULL;
    return bsearch(&probe, node.entries, node.count, sizeof *node.entries, by_key);
}

/* The file's GPU index in "gpu.<n>...." or "error.<name>.<n>", or -1. */
static long key_gpu(const char *key) {
    if (strncmp(key, "gpu.", 4) == 0) return strtol(key + 4, NULL, 10);
    if (strncmp(key, "error.", 6) == 0) {
        const char *dot = strchr(key + 6, '.');
        return dot ? strtol(dot + 1, NULL, 10) : -1;
    }
    return -1;
}

/* Reads and checks the node file into *out; on failure says why on stderr, returns 0. */
static int load_node(const char *path, struct node *out) {
    memset(out, 0, sizeof *out);
    FILE *f = fopen(path, "r");
    if (!f) { say("cannot open node file %s: %s", path, strerror(errno)); return 0; }
    struct entry *entries = calloc(MAX_ENTRIES, sizeof *entries);
    if (!entries) { fclose(f); say("out of memory"); return 0; }
    char line[MAX_LINE + 1];
    size_t count = 0, lineno = 0, bytes = 0;
    int ok = 1, c = 0;
    while (ok && c != EOF) {
        size_t len = 0;
        int printable = 1;
        lineno++;
        while ((c = getc(f)) != EOF && c != '\n') {
            if (++bytes > MAX_FILE_BYTES) break;
            if (c < 0x20 || c > 0x7e) printable = 0; /* the driver answers ASCII: so must the node */
            if (len == MAX_LINE) break;
            line[len++] = (char)c;
        }
        if (bytes > MAX_FILE_BYTES) { say("%s: larger than %d bytes", path, MAX_FILE_BYTES); ok = 0; break; }
        if (len == MAX_LINE) { say("%s:%zu: line longer than %d", path, lineno, MAX_LINE - 1); ok = 0; break; }
        if (!printable) { say("%s:%zu: not printable ASCII", path, lineno); ok = 0; break; }
        line[len] = '\0';
        if (len == 0 || line[0] == '#') continue;
        char *space = strchr(line, ' ');
        if (!space) { say("%s:%zu: expected 'key value'", path, lineno); ok = 0; break; }
        *space = '\0';
        const char *key = line, *value = space + 1;
        if (strlen(key) >= MAX_KEY || strlen(value) >= MAX_VALUE) {
            say("%s:%zu: key or value too long", path, lineno); ok = 0; break;
        }
        int kind = -1;
        for (size_t k = 0; k < sizeof KEYS / sizeof *KEYS && kind < 0; k++)
            if (matches(KEYS[k].pattern, key)) kind = KEYS[k].kind;
        if (kind < 0) { say("%s:%zu: unknown key %s", path, lineno, key); ok = 0; break; }
        if (count == MAX_ENTRIES) { say("%s: more than %d entries", path, MAX_ENTRIES); ok = 0; break; }
        struct entry *e = &entries[count];
        memcpy(e->key, key, strlen(key) + 1); /* lengths checked above */
        memcpy(e->text, value, strlen(value) + 1);
        if (kind != TEXT && !parse_number(value, kind, &e->number)) {
            say("%s:%zu: %s: %s is not a number", path, lineno, key, value); ok = 0; break;
        }
        count++;
    }
    if (ok && ferror(f)) { say("%s: read error", path); ok = 0; }
    fclose(f);
    if (ok) {
        qsort(entries, count, sizeof *entries, by_key);
        unsigned long long gpus = 0;
        for (size_t i = 0; i < count; i++)
            if (strcmp(entries[i].key, "gpu_count") == 0) gpus = entries[i].number;
        if (gpus > MAX_GPUS) { say("%s: gpu_count %llu > %d", path, gpus, MAX_GPUS); ok = 0; }
        for (size_t i = 0; ok && i < count; i++) {
            if (i > 0 && strcmp(entries[i - 1].key, entries[i].key) == 0) {
                say("%s: %s given twice", path, entries[i].key); ok = 0;
            }
            long gpu = key_gpu(entries[i].key);
            if (ok && gpu >= 0 && (unsigned long long)gpu >= gpus) {
                say("%s: %s: no GPU %ld (gpu_count %llu)", path, entries[i].key, gpu, gpus); ok = 0;
            }
            unsigned link;
            if (ok && sscanf(entries[i].key, "gpu.%*u.nvlink.%u.", &link) == 1 && link >= MAX_LINKS) {
                say("%s: %s: link >= %d", path, entries[i].key, MAX_LINKS); ok = 0;
            }
        }
        out->gpu_count = (unsigned)gpus;
    }
    if (!ok) { free(entries); memset(out, 0, sizeof *out); return 0; }
    out->entries = entries;
    out->count = count;
    return 1;
}

static int same_file(const struct stat *a, const struct stat *b) {
    return a->st_ino == b->st_ino && a->st_dev == b->st_dev && a->st_size == b->st_size &&
           a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec;
}

/* Loads the node file if it is new or changed since the last load. */
static nvmlReturn_t refresh(int first) {
    struct stat now;
    if (stat(node_path, &now) != 0) {
        if (first) return NVML_ERROR_DRIVER_NOT_LOADED; /* no node: as a machine without the driver */
        say("node file %s: %s", node_path, strerror(errno));
        return NVML_ERROR_UNKNOWN;
    }
    if (!first && same_file(&now, &node_seen)) return NVML_SUCCESS;
    struct node fresh;
    if (!load_node(node_path, &fresh)) return NVML_ERROR_UNKNOWN;
    free(node.entries);
    node = fresh;
    node_seen = now;
    return NVML_SUCCESS;
}

/* --- helpers every call uses ---------------------------------------------------------- */

/* The error the node file plants for this call (on this GPU, gpu >= 0), or SUCCESS. */
static nvmlReturn_t planted(const char *function, long gpu) {
    const struct entry *e = gpu >= 0 ? find("error.%s.%ld", function, gpu) : NULL;
    if (!e) e = find("error.%s", function);
    return e ? (nvmlReturn_t)(int)e->number : NVML_SUCCESS;
}

/* Is device one of ours, for a GPU the node has now? */
static int valid_device(nvmlDevice_t device) {
    uintptr_t p = (uintptr_t)device, base = (uintptr_t)devices;
    if (p < base || p >= base + sizeof devices || (p - base) % sizeof *devices != 0) return 0;
    return device->index < node.gpu_count;
}

/* Common entry: initialised, handle valid, no planted error. */
#define ENTER_SYSTEM()                                                            \
    pthread_mutex_lock(&lock);                                                    \
    nvmlReturn_t ret = refcount == 0 ? NVML_ERROR_UNINITIALIZED : planted(__func__, -1); \
    if (ret != NVML_SUCCESS) goto out

#define ENTER_DEVICE(device)                                                      \
    pthread_mutex_lock(&lock);                                                    \
    nvmlReturn_t ret = NVML_SUCCESS;                                              \
    if (refcount == 0) { ret = NVML_ERROR_UNINITIALIZED; goto out; }              \
    if (!valid_device(device)) { ret = NVML_ERROR_INVALID_ARGUMENT; goto out; }   \
    unsigned gpu = (device)->index;                                               \
    ret = planted(__func__, gpu);                                                 \
    if (ret != NVML_SUCCESS) goto out

#define LEAVE() out: pthread_mutex_unlock(&lock); return ret

#define NEED(pointer) if (!(pointer)) { ret = NVML_ERROR_INVALID_ARGUMENT; goto out; }

/* Copies a text value into a caller's buffer of length bytes. */
static nvmlReturn_t put_text(const struct entry *e, char *buffer, unsigned length) {
    if (!e) return NVML_ERROR_NOT_SUPPORTED;
    if (strlen(e->text) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buffer, e->text, strlen(e->text) + 1);
    return NVML_SUCCESS;
}

/* Parses "dddd:bb:dd.f" or "dddddddd:bb:dd.f" into nvmlPciInfo_t as the driver fills it. */
static nvmlReturn_t put_pci(const struct entry *e, unsigned long long device_id,
                            unsigned long long subsystem_id, nvmlPciInfo_t *pci) {
    if (!e) return NVML_ERROR_NOT_SUPPORTED;
    unsigned domain, bus, dev, function;
    char tail;
    if (sscanf(e->text, "%x:%x:%x.%x%c", &domain, &bus, &dev, &function, &tail) != 4 || bus > 0xff ||
        dev > 0x1f || function > 7) {
        say("%s: %s is not a PCI bus id", e->key, e->text);
        return NVML_ERROR_UNKNOWN;
    }
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", domain & 0xffff, bus, dev, function);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", domain, bus, dev, function);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = (unsigned)device_id;
    pci->pciSubSystemId = (unsigned)subsystem_id;
    return NVML_SUCCESS;
}

static unsigned long long number_or(const struct entry *e, unsigned long long otherwise) {
    return e ? e->number : otherwise;
}

/* --- init, shutdown, errors ----------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    nvmlReturn_t ret = NVML_SUCCESS;
    if (refcount == 0) {
        const char *path = getenv("TOPOAGENT_NVML_STUB_NODE");
        const char *events = getenv("TOPOAGENT_NVML_STUB_EVENTS");
        if (!path || !*path || strlen(path) >= sizeof node_path) { ret = NVML_ERROR_DRIVER_NOT_LOADED; goto out; }
        snprintf(node_path, sizeof node_path, "%s", path);
        snprintf(events_path, sizeof events_path, "%s", events && strlen(events) < sizeof events_path ? events : "");
        ret = refresh(1);
        if (ret != NVML_SUCCESS) goto out;
        memset(event_sets, 0, sizeof event_sets);
        for (unsigned i = 0; i < MAX_GPUS; i++) devices[i].index = i;
    }
    ret = planted(__func__, -1);
    if (ret == NVML_SUCCESS) refcount++;
    LEAVE();
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

EXPORT nvmlReturn_t nvmlShutdown(void) {
    ENTER_SYSTEM();
    if (--refcount == 0) memset(event_sets, 0, sizeof event_sets); /* NVML frees them with itself */
    LEAVE();
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument Version Mismatch";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    default: return "Unknown Error (nvml stub)";
    }
}

/* --- system --------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    ENTER_SYSTEM();
    NEED(version);
    ret = put_text(find("driver_version"), version, length);
    LEAVE();
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    ENTER_SYSTEM();
    NEED(version);
    ret = put_text(find("nvml_version"), version, length);
    LEAVE();
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    ENTER_SYSTEM();
    NEED(cudaDriverVersion);
    const struct entry *e = find("cuda_driver_version");
    if (!e) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    *cudaDriverVersion = (int)e->number;
    LEAVE();
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t ret = refcount == 0 ? NVML_ERROR_UNINITIALIZED : refresh(0);
    if (ret == NVML_SUCCESS) ret = planted(__func__, -1);
    if (ret != NVML_SUCCESS) goto out;
    NEED(deviceCount);
    *deviceCount = node.gpu_count;
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t ret = refcount == 0 ? NVML_ERROR_UNINITIALIZED : refresh(0);
    if (ret != NVML_SUCCESS) goto out;
    if (index >= node.gpu_count) { ret = NVML_ERROR_INVALID_ARGUMENT; goto out; }
    ret = planted(__func__, index);
    if (ret != NVML_SUCCESS) goto out;
    NEED(device);
    *device = &devices[index];
    LEAVE();
}

/* --- identity, PCI, memory, affinity -------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    ENTER_DEVICE(device);
    NEED(uuid);
    ret = put_text(find("gpu.%u.uuid", gpu), uuid, length);
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    ENTER_DEVICE(device);
    NEED(name);
    ret = put_text(find("gpu.%u.name", gpu), name, length);
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    ENTER_DEVICE(device);
    NEED(pci);
    ret = put_pci(find("gpu.%u.pci.bus_id", gpu), number_or(find("gpu.%u.pci.device_id", gpu), 0),
                  number_or(find("gpu.%u.pci.subsystem_id", gpu), 0), pci);
    LEAVE();
}

/* v1: its `used` counts the reserved memory too (nvml.h: "Sum of Reserved and Allocated"). */
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    ENTER_DEVICE(device);
    NEED(memory);
    const struct entry *total = find("gpu.%u.memory.total", gpu), *free_ = find("gpu.%u.memory.free", gpu),
                       *used = find("gpu.%u.memory.used", gpu);
    if (!total || !free_ || !used) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    memory->total = total->number;
    memory->free = free_->number;
    memory->used = used->number + number_or(find("gpu.%u.memory.reserved", gpu), 0);
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    ENTER_DEVICE(device);
    NEED(memory);
    if (memory->version != nvmlMemory_v2) { ret = NVML_ERROR_ARGUMENT_VERSION_MISMATCH; goto out; }
    const struct entry *total = find("gpu.%u.memory.total", gpu), *free_ = find("gpu.%u.memory.free", gpu),
                       *used = find("gpu.%u.memory.used", gpu), *reserved = find("gpu.%u.memory.reserved", gpu);
    if (!total || !free_ || !used || !reserved) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    memory->total = total->number;
    memory->free = free_->number;
    memory->used = used->number;
    memory->reserved = reserved->number;
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *numaNode) {
    ENTER_DEVICE(device);
    NEED(numaNode);
    const struct entry *e = find("gpu.%u.numa_node", gpu);
    if (!e) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    *numaNode = (unsigned)e->number;
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize, unsigned long *cpuSet) {
    ENTER_DEVICE(device);
    NEED(cpuSet);
    int any = 0;
    for (unsigned w = 0; w < MAX_AFFINITY_WORDS; w++) {
        const struct entry *e = find("gpu.%u.cpu_affinity.%u", gpu, w);
        if (!e) continue;
        any = 1;
        if (w >= cpuSetSize && e->number) { ret = NVML_ERROR_INSUFFICIENT_SIZE; goto out; }
    }
    if (!any) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    for (unsigned w = 0; w < cpuSetSize; w++)
        cpuSet[w] = w < MAX_AFFINITY_WORDS ? (unsigned long)number_or(find("gpu.%u.cpu_affinity.%u", gpu, w), 0) : 0;
    LEAVE();
}

/* --- NVLink, P2P ---------------------------------------------------------------------- */

/* A link the node file names at all: any key under gpu.N.nvlink.L. */
static int link_exists(unsigned gpu, unsigned link) {
    return link < MAX_LINKS && find("gpu.%u.nvlink.%u.state", gpu, link) != NULL;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive) {
    ENTER_DEVICE(device);
    NEED(isActive);
    if (link >= MAX_LINKS) { ret = NVML_ERROR_INVALID_ARGUMENT; goto out; }
    if (!link_exists(gpu, link)) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    *isActive = find("gpu.%u.nvlink.%u.state", gpu, link)->number ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t device, unsigned int link, unsigned int *version) {
    ENTER_DEVICE(device);
    NEED(version);
    if (link >= MAX_LINKS) { ret = NVML_ERROR_INVALID_ARGUMENT; goto out; }
    const struct entry *e = link_exists(gpu, link) ? find("gpu.%u.nvlink.%u.version", gpu, link) : NULL;
    if (!e) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    *version = (unsigned)e->number;
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci) {
    ENTER_DEVICE(device);
    NEED(pci);
    if (link >= MAX_LINKS) { ret = NVML_ERROR_INVALID_ARGUMENT; goto out; }
    const struct entry *e = link_exists(gpu, link) ? find("gpu.%u.nvlink.%u.remote_bus_id", gpu, link) : NULL;
    ret = put_pci(e, 0, 0, pci);
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                        nvmlIntNvLinkDeviceType_t *pNvLinkDeviceType) {
    ENTER_DEVICE(device);
    NEED(pNvLinkDeviceType);
    if (link >= MAX_LINKS) { ret = NVML_ERROR_INVALID_ARGUMENT; goto out; }
    const struct entry *e = link_exists(gpu, link) ? find("gpu.%u.nvlink.%u.remote_type", gpu, link) : NULL;
    if (!e) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    *pNvLinkDeviceType = (nvmlIntNvLinkDeviceType_t)e->number;
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned int link,
                                                    nvmlNvLinkErrorCounter_t counter, unsigned long long *counterValue) {
    ENTER_DEVICE(device);
    NEED(counterValue);
    if (link >= MAX_LINKS) { ret = NVML_ERROR_INVALID_ARGUMENT; goto out; }
    const struct entry *e = link_exists(gpu, link) ? find("gpu.%u.nvlink.%u.error.%u", gpu, link, (unsigned)counter) : NULL;
    if (!e) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    *counterValue = e->number;
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2, nvmlGpuP2PCapsIndex_t p2pIndex,
                                           nvmlGpuP2PStatus_t *p2pStatus) {
    ENTER_DEVICE(device1);
    NEED(p2pStatus);
    if (!valid_device(device2)) { ret = NVML_ERROR_INVALID_ARGUMENT; goto out; }
    const struct entry *e = find("gpu.%u.p2p.%u.%u", gpu, device2->index, (unsigned)p2pIndex);
    if (!e) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    *p2pStatus = (nvmlGpuP2PStatus_t)e->number;
    LEAVE();
}

/* --- fabric --------------------------------------------------------------------------- */

/* The fabric fields common to every version of the struct; state decides if there is one. */
static nvmlReturn_t fabric(unsigned gpu, unsigned char uuid[NVML_GPU_FABRIC_UUID_LEN], nvmlReturn_t *status,
                           unsigned int *clique, nvmlGpuFabricState_t *state) {
    const struct entry *e = find("gpu.%u.fabric.state", gpu);
    if (!e) return NVML_ERROR_NOT_SUPPORTED;
    memset(uuid, 0, NVML_GPU_FABRIC_UUID_LEN);
    const struct entry *u = find("gpu.%u.fabric.cluster_uuid", gpu);
    if (u) { /* 32 hex digits, dashes allowed */
        unsigned n = 0;
        for (const char *c = u->text; *c && n < 2 * NVML_GPU_FABRIC_UUID_LEN; c++) {
            if (*c == '-') continue;
            if (!isxdigit((unsigned char)*c)) { say("%s: not hex", u->key); return NVML_ERROR_UNKNOWN; }
            unsigned digit = isdigit((unsigned char)*c) ? (unsigned)(*c - '0') : (unsigned)(tolower(*c) - 'a' + 10);
            uuid[n / 2] |= (unsigned char)(n % 2 ? digit : digit << 4);
            n++;
        }
    }
    *status = (nvmlReturn_t)number_or(find("gpu.%u.fabric.status", gpu), 0);
    *clique = (unsigned)number_or(find("gpu.%u.fabric.clique_id", gpu), 0);
    *state = (nvmlGpuFabricState_t)e->number;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, nvmlGpuFabricInfo_t *info) {
    ENTER_DEVICE(device);
    NEED(info);
    ret = fabric(gpu, info->clusterUuid, &info->status, &info->cliqueId, &info->state);
    LEAVE();
}

/* Versioned: the caller sets .version (v2 or v3); v3 adds healthSummary. */
EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfoV_t *info) {
    ENTER_DEVICE(device);
    NEED(info);
    if (info->version != nvmlGpuFabricInfo_v2 && info->version != nvmlGpuFabricInfo_v3) {
        ret = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        goto out;
    }
    ret = fabric(gpu, info->clusterUuid, &info->status, &info->cliqueId, &info->state);
    if (ret != NVML_SUCCESS) goto out;
    info->healthMask = (unsigned)number_or(find("gpu.%u.fabric.health_mask", gpu), 0);
    if (info->version == nvmlGpuFabricInfo_v3)
        info->healthSummary = (unsigned char)number_or(find("gpu.%u.fabric.health_summary", gpu), 0);
    LEAVE();
}

/* --- counters ------------------------------------------------------------------------- */

/* Calls that answer one unsigned number from one key. */
#define ONE_NUMBER(function, type, pointer, ...)                       \
    EXPORT nvmlReturn_t function(nvmlDevice_t device, type *pointer) { \
        ENTER_DEVICE(device);                                          \
        NEED(pointer);                                                 \
        const struct entry *e = find(__VA_ARGS__);                     \
        if (!e) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }          \
        *pointer = (type)e->number;                                    \
        LEAVE();                                                       \
    }

ONE_NUMBER(nvmlDeviceGetPowerUsage, unsigned int, power, "gpu.%u.power_mw", gpu)
ONE_NUMBER(nvmlDeviceGetEnforcedPowerLimit, unsigned int, limit, "gpu.%u.power_limit_mw", gpu)
ONE_NUMBER(nvmlDeviceGetTotalEnergyConsumption, unsigned long long, energy, "gpu.%u.energy_mj", gpu)
ONE_NUMBER(nvmlDeviceGetCurrentClocksEventReasons, unsigned long long, reasons, "gpu.%u.clocks_event_reasons", gpu)
ONE_NUMBER(nvmlDeviceGetCurrentClocksThrottleReasons, unsigned long long, reasons, "gpu.%u.clocks_event_reasons", gpu)
ONE_NUMBER(nvmlDeviceGetRetiredPagesPendingStatus, nvmlEnableState_t, isPending, "gpu.%u.retired_pages_pending", gpu)

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType, unsigned int *temp) {
    ENTER_DEVICE(device);
    NEED(temp);
    const struct entry *e = find("gpu.%u.temperature.%u", gpu, (unsigned)sensorType);
    if (!e) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    *temp = (unsigned)e->number;
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock) {
    ENTER_DEVICE(device);
    NEED(clock);
    const struct entry *e = find("gpu.%u.clock.%u", gpu, (unsigned)type);
    if (!e) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    *clock = (unsigned)e->number;
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                                nvmlEccCounterType_t counterType, unsigned long long *eccCounts) {
    ENTER_DEVICE(device);
    NEED(eccCounts);
    const struct entry *e = find("gpu.%u.ecc.%u.%u", gpu, (unsigned)errorType, (unsigned)counterType);
    if (!e) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    *eccCounts = e->number;
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    ENTER_DEVICE(device);
    NEED(utilization);
    const struct entry *g = find("gpu.%u.utilization.gpu", gpu), *m = find("gpu.%u.utilization.memory", gpu);
    if (!g || !m) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    utilization->gpu = (unsigned)g->number;
    utilization->memory = (unsigned)m->number;
    LEAVE();
}

#define SAMPLING_PERIOD_US 1000000 /* what the node file cannot say; NVML's is 1/6 s to 1 s */

EXPORT nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                                    unsigned int *samplingPeriodUs) {
    ENTER_DEVICE(device);
    NEED(utilization);
    NEED(samplingPeriodUs);
    const struct entry *e = find("gpu.%u.utilization.encoder", gpu);
    if (!e) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    *utilization = (unsigned)e->number;
    *samplingPeriodUs = SAMPLING_PERIOD_US;
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                                    unsigned int *samplingPeriodUs) {
    ENTER_DEVICE(device);
    NEED(utilization);
    NEED(samplingPeriodUs);
    const struct entry *e = find("gpu.%u.utilization.decoder", gpu);
    if (!e) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    *utilization = (unsigned)e->number;
    *samplingPeriodUs = SAMPLING_PERIOD_US;
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                              unsigned int *isPending, unsigned int *failureOccurred) {
    ENTER_DEVICE(device);
    NEED(corrRows);
    NEED(uncRows);
    NEED(isPending);
    NEED(failureOccurred);
    const struct entry *c = find("gpu.%u.remapped_rows.correctable", gpu), *u = find("gpu.%u.remapped_rows.uncorrectable", gpu),
                       *p = find("gpu.%u.remapped_rows.pending", gpu), *f = find("gpu.%u.remapped_rows.failure", gpu);
    if (!c || !u || !p || !f) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    *corrRows = (unsigned)c->number;
    *uncRows = (unsigned)u->number;
    *isPending = (unsigned)p->number;
    *failureOccurred = (unsigned)f->number;
    LEAVE();
}

/* The two-call protocol: too small a buffer (or none) -> INSUFFICIENT_SIZE and the count needed. */
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos) {
    ENTER_DEVICE(device);
    NEED(infoCount);
    const struct entry *n = find("gpu.%u.process_count", gpu);
    if (!n) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; }
    unsigned count = n->number > MAX_PROCESSES ? MAX_PROCESSES : (unsigned)n->number;
    if (*infoCount < count || (count > 0 && !infos)) {
        *infoCount = count;
        ret = NVML_ERROR_INSUFFICIENT_SIZE;
        goto out;
    }
    for (unsigned i = 0; i < count; i++) {
        infos[i].pid = (unsigned)number_or(find("gpu.%u.process.%u.pid", gpu, i), 0);
        infos[i].usedGpuMemory = number_or(find("gpu.%u.process.%u.used_memory", gpu, i), 0);
        infos[i].gpuInstanceId = 0xFFFFFFFF; /* no MIG */
        infos[i].computeInstanceId = 0xFFFFFFFF;
    }
    *infoCount = count;
    LEAVE();
}

/* Per entry: the value of (fieldId, scopeId), or NOT_SUPPORTED in that entry's nvmlReturn. */
EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values) {
    ENTER_DEVICE(device);
    NEED(values);
    if (valuesCount < 0) { ret = NVML_ERROR_INVALID_ARGUMENT; goto out; }
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        const struct entry *e = find("gpu.%u.field.%u.%u", gpu, v->fieldId, v->scopeId);
        v->timestamp = (long long)now.tv_sec * 1000000 + now.tv_nsec / 1000;
        v->latencyUsec = 0;
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
        v->nvmlReturn = e ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
        memset(&v->value, 0, sizeof v->value);
        if (e) v->value.ullVal = e->number;
    }
    LEAVE();
}

/* --- Xid events ----------------------------------------------------------------------- */

static int valid_set(nvmlEventSet_t set) {
    uintptr_t p = (uintptr_t)set, base = (uintptr_t)event_sets;
    return p >= base && p < base + sizeof event_sets && (p - base) % sizeof *event_sets == 0 && set->in_use;
}

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    ENTER_SYSTEM();
    NEED(set);
    for (unsigned i = 0; i < MAX_EVENT_SETS; i++) {
        if (!event_sets[i].in_use) {
            memset(&event_sets[i], 0, sizeof event_sets[i]);
            event_sets[i].in_use = 1;
            *set = &event_sets[i];
            goto out;
        }
    }
    ret = NVML_ERROR_MEMORY;
    LEAVE();
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set) {
    ENTER_DEVICE(device);
    if (!valid_set(set)) { ret = NVML_ERROR_INVALID_ARGUMENT; goto out; }
    if (eventTypes & ~(unsigned long long)XID_EVENT) { ret = NVML_ERROR_NOT_SUPPORTED; goto out; } /* Xids only */
    set->registered[gpu] |= eventTypes;
    LEAVE();
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    ENTER_SYSTEM();
    if (!valid_set(set)) { ret = NVML_ERROR_INVALID_ARGUMENT; goto out; }
    set->in_use = 0;
    LEAVE();
}

/* The next event in the events file for a GPU this set registered, advancing its offset past
 * every whole line read; a line still being written (no newline yet) waits for its end. */
static int next_event(nvmlEventSet_t set, nvmlEventData_t *data) {
    if (!events_path[0]) return 0;
    FILE *f = fopen(events_path, "r");
    if (!f) return 0;
    int found = 0;
    while (!found && fseek(f, set->offset, SEEK_SET) == 0) {
        char line[MAX_EVENT_LINE + 1];
        size_t len = 0;
        int c, complete = 0, bad = 0;
        while ((c = fgetc(f)) != EOF) {
            if (c == '\n') { complete = 1; break; }
            if (len < MAX_EVENT_LINE && c >= 0x20 && c <= 0x7e) line[len++] = (char)c;
            else bad = 1; /* too long, or not printable */
        }
        if (!complete) break;
        set->offset = ftell(f);
        line[len] = '\0';
        unsigned gpu;
        unsigned long long xid;
        char tail;
        if (bad || sscanf(line, "%u %llu %c", &gpu, &xid, &tail) != 2) {
            say("%s: malformed event line skipped", events_path);
            continue;
        }
        if (gpu >= node.gpu_count || !(set->registered[gpu] & XID_EVENT)) continue; /* not for this set */
        memset(data, 0, sizeof *data);
        data->device = &devices[gpu];
        data->eventType = XID_EVENT;
        data->eventData = xid;
        data->gpuInstanceId = 0xFFFFFFFF;
        data->computeInstanceId = 0xFFFFFFFF;
        found = 1;
    }
    fclose(f);
    return found;
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    struct timespec start, now, pause = {0, 10 * 1000 * 1000};
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        pthread_mutex_lock(&lock);
        nvmlReturn_t ret = refcount == 0 ? NVML_ERROR_UNINITIALIZED : planted(__func__, -1);
        if (ret == NVML_SUCCESS && (!valid_set(set) || !data)) ret = NVML_ERROR_INVALID_ARGUMENT;
        if (ret == NVML_SUCCESS && !next_event(set, data)) ret = NVML_ERROR_TIMEOUT;
        pthread_mutex_unlock(&lock);
        if (ret != NVML_ERROR_TIMEOUT) return ret;
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long waited_ms = (now.tv_sec - start.tv_sec) * 1000LL + (now.tv_nsec - start.tv_nsec) / 1000000;
        if (waited_ms >= (long long)timeoutms) return NVML_ERROR_TIMEOUT;
        nanosleep(&pause, NULL); /* the lock is free meanwhile: other threads go on */
    }
}
