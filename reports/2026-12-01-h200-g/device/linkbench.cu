// link rates for copying a host tail to the device, by path (rollkv issue 12 measurement, not shipped)
// build: nvcc -O2 -arch=sm_90 linkbench.cu -lcuda -o linkbench
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
#define CU(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char * s_; cuGetErrorString(r_, &s_); fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); exit(1); } } while (0)

static __global__ void k_copy(const int4 * __restrict__ src, int4 * __restrict__ dst, int64_t n) {
    constexpr int unroll = 4;
    const int64_t stride = (int64_t) gridDim.x*blockDim.x;
    int64_t i = (int64_t) blockIdx.x*blockDim.x + threadIdx.x;
    for (; i + (unroll - 1)*stride < n; i += unroll*stride) {
        int4 v[unroll];
#pragma unroll
        for (int u = 0; u < unroll; ++u) v[u] = src[i + u*stride];
#pragma unroll
        for (int u = 0; u < unroll; ++u) dst[i + u*stride] = v[u];
    }
    for (; i < n; i += stride) dst[i] = src[i];
}

static const size_t NB = 256ull << 20; // bytes per copy
static const int REPS = 7;

template <class F> static double rate(const char * what, F launch, std::vector<cudaStream_t> & streams) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<double> gbs;
    for (int r = 0; r < REPS; ++r) {
        CK(cudaDeviceSynchronize());
        CK(cudaEventRecord(a, streams[0]));
        std::vector<cudaEvent_t> forks;
        for (size_t s = 1; s < streams.size(); ++s) CK(cudaStreamWaitEvent(streams[s], a));
        launch();
        for (size_t s = 1; s < streams.size(); ++s) {
            cudaEvent_t e; CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
            CK(cudaEventRecord(e, streams[s])); CK(cudaStreamWaitEvent(streams[0], e)); forks.push_back(e);
        }
        CK(cudaEventRecord(b, streams[0]));
        CK(cudaEventSynchronize(b));
        float ms; CK(cudaEventElapsedTime(&ms, a, b));
        gbs.push_back(NB/1e9/(ms/1e3));
        for (auto e : forks) cudaEventDestroy(e);
    }
    std::sort(gbs.begin(), gbs.end());
    printf("%-58s median %6.2f GB/s  (min %6.2f max %6.2f)\n", what, gbs[REPS/2], gbs[0], gbs[REPS-1]);
    fflush(stdout);
    return gbs[REPS/2];
}

int main() {
    CK(cudaSetDevice(0));
    CK(cudaFree(0));
    CUdevice dev; CU(cuDeviceGet(&dev, 0));
    int numa = -1; cuDeviceGetAttribute(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, dev);
    int nsm = 0; CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    int n_ce = 0; CK(cudaDeviceGetAttribute(&n_ce, cudaDevAttrAsyncEngineCount, 0));
    printf("host numa id %d, SMs %d, async engines %d\n", numa, nsm, n_ce);

    // a window-like range: device segment then host segment, one VA range
    CUmemAllocationProp pd = {}; pd.type = CU_MEM_ALLOCATION_TYPE_PINNED; pd.location.type = CU_MEM_LOCATION_TYPE_DEVICE; pd.location.id = 0;
    CUmemAllocationProp ph = {}; ph.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    if (numa >= 0) { ph.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA; ph.location.id = numa; } else { ph.location.type = CU_MEM_LOCATION_TYPE_HOST; ph.location.id = 0; }
    size_t gran = 0; CU(cuMemGetAllocationGranularity(&gran, &ph, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    size_t gd = 0; CU(cuMemGetAllocationGranularity(&gd, &pd, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    gran = std::max(gran, gd);
    const size_t seg = ((NB + gran - 1)/gran)*gran;
    CUdeviceptr base; CU(cuMemAddressReserve(&base, 2*seg, 0, 0, 0));
    CUmemGenericAllocationHandle hd, hh;
    CU(cuMemCreate(&hd, seg, &pd, 0)); CU(cuMemCreate(&hh, seg, &ph, 0));
    CU(cuMemMap(base, seg, 0, hd, 0)); CU(cuMemMap(base + seg, seg, 0, hh, 0));
    CUmemAccessDesc acc = {}; acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE; acc.location.id = 0; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU(cuMemSetAccess(base, 2*seg, &acc, 1));
    // the host segment mapped a second time with CPU access too (a host VA of the same pages)
    CUdeviceptr hva; CU(cuMemAddressReserve(&hva, seg, 0, 0, 0)); CU(cuMemMap(hva, seg, 0, hh, 0));
    CUmemAccessDesc acc2[2] = {}; acc2[0] = acc;
    acc2[1].location.type = ph.location.type; acc2[1].location.id = ph.location.id; acc2[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUresult hres = cuMemSetAccess(hva, seg, acc2, 2);
    bool host_va = hres == CUDA_SUCCESS;
    if (!host_va) { const char * s; cuGetErrorString(hres, &s); printf("host access to the VMM host segment refused: %s\n", s); }
    else { memset((void *) hva, 1, 4096); printf("host VA of the VMM host segment: CPU access ok\n"); }

    const char * vmm_host = (const char *) (base + seg);
    char * dst; CK(cudaMalloc(&dst, NB));
    char * pinned; CK(cudaHostAlloc(&pinned, NB, cudaHostAllocMapped));
    memset(pinned, 2, NB);
    char * pinned_dev; CK(cudaHostGetDevicePointer((void **) &pinned_dev, pinned, 0));

    std::vector<cudaStream_t> s1(1), s2(2), s4(4);
    for (auto * v : { &s1, &s2, &s4 }) for (auto & s : *v) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

    char label[128];
    for (int blocks : { 8, 16, 33, 66, 132, 528 }) {
        snprintf(label, sizeof(label), "SM copy, VMM host segment, %d blocks", blocks);
        rate(label, [&] { k_copy<<<blocks, 256, 0, s1[0]>>>((const int4 *) vmm_host, (int4 *) dst, NB/16); }, s1);
    }
    for (int blocks : { 8, 132 }) {
        snprintf(label, sizeof(label), "SM copy, cudaHostAlloc mapped, %d blocks", blocks);
        rate(label, [&] { k_copy<<<blocks, 256, 0, s1[0]>>>((const int4 *) pinned_dev, (int4 *) dst, NB/16); }, s1);
    }
    for (auto * v : { &s1, &s2, &s4 }) {
        const size_t k = v->size(); const size_t part = NB/k;
        snprintf(label, sizeof(label), "engine D2D from the VMM range, %zu stream(s)", k);
        rate(label, [&] { for (size_t s = 0; s < k; ++s) CK(cudaMemcpyAsync(dst + s*part, vmm_host + s*part, part, cudaMemcpyDeviceToDevice, (*v)[s])); }, *v);
        if (host_va) {
            snprintf(label, sizeof(label), "engine Default from the host VA of it, %zu stream(s)", k);
            rate(label, [&] { for (size_t s = 0; s < k; ++s) CK(cudaMemcpyAsync(dst + s*part, (const char *) hva + s*part, part, cudaMemcpyDefault, (*v)[s])); }, *v);
        }
        snprintf(label, sizeof(label), "engine H2D from cudaHostAlloc, %zu stream(s)", k);
        rate(label, [&] { for (size_t s = 0; s < k; ++s) CK(cudaMemcpyAsync(dst + s*part, pinned + s*part, part, cudaMemcpyHostToDevice, (*v)[s])); }, *v);
    }
    // chunked like a layer's K or V tail at 16k (about 4 MiB): many small engine copies back to back
    for (size_t chunk : { (size_t) 4 << 20, (size_t) 16 << 20 }) {
        snprintf(label, sizeof(label), "engine D2D from the VMM range, %zu MiB pieces, 1 stream", chunk >> 20);
        rate(label, [&] { for (size_t o = 0; o < NB; o += chunk) CK(cudaMemcpyAsync(dst + o, vmm_host + o, chunk, cudaMemcpyDeviceToDevice, s1[0])); }, s1);
        snprintf(label, sizeof(label), "SM copy 8 blocks, %zu MiB pieces, 1 stream", chunk >> 20);
        rate(label, [&] { for (size_t o = 0; o < NB; o += chunk) k_copy<<<8, 256, 0, s1[0]>>>((const int4 *) (vmm_host + o), (int4 *) (dst + o), chunk/16); }, s1);
    }
    {
        const size_t half = NB/2;
        rate("SM 8 blocks on one half + engine D2D on the other, 2 streams", [&] {
            k_copy<<<8, 256, 0, s2[0]>>>((const int4 *) vmm_host, (int4 *) dst, half/16);
            CK(cudaMemcpyAsync(dst + half, vmm_host + half, half, cudaMemcpyDeviceToDevice, s2[1]));
        }, s2);
        rate("SM 8 blocks on one half + SM 8 blocks on the other, 2 streams", [&] {
            k_copy<<<8, 256, 0, s2[0]>>>((const int4 *) vmm_host, (int4 *) dst, half/16);
            k_copy<<<8, 256, 0, s2[1]>>>((const int4 *) (vmm_host + half), (int4 *) (dst + half), half/16);
        }, s2);
    }
    printf("done\n");
    return 0;
}
