// A recording stand-in for the CUDA runtime, linked (nvcc -cudart none) into
// launch_probe.cu so that the torch-free launcher runs on a machine without a GPU and
// prints every kernel launch it makes instead of making it: grid, block, dynamic shared
// memory, whether it was a chained (cudaLaunchKernelEx) launch, every argument's value
// (read by the parameter types of the kernel's demangled signature) and the name.
//
// The device it describes: one H100/H200-like GPU (132 SMs, 227 KiB of opt-in shared
// memory per block, compute capability 9.0), two resident blocks per SM for every
// kernel, streams never captured. Only the symbols the launcher's translation units
// reference are defined.
#include <cuda_runtime_api.h>
#include <cxxabi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace {

// host stub address -> the kernel's device (mangled) name, from the registration that
// runs before main
std::map<const void*, std::string>& kernel_names() {
  static std::map<const void*, std::string> names;
  return names;
}

struct PendingLaunch {
  dim3 grid, block;
  size_t smem = 0;
};
PendingLaunch pending;

std::string demangled(const std::string& mangled) {
  int status = 0;
  char* text = abi::__cxa_demangle(mangled.c_str(), nullptr, nullptr, &status);
  if (status != 0 || text == nullptr) return mangled;
  std::string out(text);
  std::free(text);
  return out;
}

// The parameter types of a demangled signature "name<...>(T1, T2, ...)".
std::vector<std::string> parameter_types(const std::string& name) {
  std::vector<std::string> types;
  const size_t open = name.rfind('(');
  if (open == std::string::npos || name.back() != ')') return types;
  const std::string list = name.substr(open + 1, name.size() - open - 2);
  size_t start = 0;
  while (start < list.size()) {
    size_t end = list.find(", ", start);
    if (end == std::string::npos) end = list.size();
    types.push_back(list.substr(start, end - start));
    start = end + 2;
  }
  return types;
}

// One argument as a token: p<hex> a pointer, i<dec> an integer, f<hex> a float's bits.
std::string argument(const std::string& type, void* value) {
  char text[40];
  if (!type.empty() && type.back() == '*') {
    std::snprintf(text, sizeof text, "p%llx",
                  static_cast<unsigned long long>(
                      reinterpret_cast<std::uintptr_t>(*static_cast<void**>(value))));
  } else if (type == "long long") {
    std::snprintf(text, sizeof text, "i%lld", *static_cast<long long*>(value));
  } else if (type == "int") {
    std::snprintf(text, sizeof text, "i%d", *static_cast<int*>(value));
  } else if (type == "float") {
    unsigned bits;
    std::memcpy(&bits, value, sizeof bits);
    std::snprintf(text, sizeof text, "f%08x", bits);
  } else {
    std::fprintf(stderr, "fake_cudart: kernel parameter type \"%s\" not described\n",
                 type.c_str());
    std::exit(3);
  }
  return text;
}

void record(const void* handle, dim3 grid, dim3 block, size_t smem, int chained, void** args) {
  const auto found = kernel_names().find(handle);
  const std::string name =
      found == kernel_names().end() ? std::string("?") : demangled(found->second);
  const std::vector<std::string> types = parameter_types(name);
  std::printf("L %u %u %u %u %u %u %zu %d %zu", grid.x, grid.y, grid.z, block.x, block.y,
              block.z, smem, chained, types.size());
  for (size_t i = 0; i < types.size(); ++i)
    std::printf(" %s", argument(types[i], args[i]).c_str());
  std::printf(" %s\n", name.c_str());
}

char fatbin_handle_storage;
void* fatbin_handle = &fatbin_handle_storage;

}  // namespace

extern "C" {

void** __cudaRegisterFatBinary(void*) { return &fatbin_handle; }
void __cudaRegisterFatBinaryEnd(void**) {}
void __cudaUnregisterFatBinary(void**) {}
char __cudaInitModule(void**) { return 1; }

void __cudaRegisterFunction(void**, const char* hostFun, char*, const char* deviceName, int,
                            uint3*, uint3*, dim3*, dim3*, int*) {
  kernel_names()[hostFun] = deviceName;
}

void __cudaRegisterVar(void**, char*, char*, const char*, int, size_t, int, int) {}

unsigned __cudaPushCallConfiguration(dim3 gridDim, dim3 blockDim, size_t sharedMem,
                                     struct CUstream_st*) {
  pending.grid = gridDim;
  pending.block = blockDim;
  pending.smem = sharedMem;
  return 0;
}

cudaError_t __cudaPopCallConfiguration(dim3* gridDim, dim3* blockDim, size_t* sharedMem,
                                       void* stream) {
  *gridDim = pending.grid;
  *blockDim = pending.block;
  *sharedMem = pending.smem;
  *static_cast<cudaStream_t*>(stream) = nullptr;
  return cudaSuccess;
}

// The launch handle of a kernel is its host stub's address.
cudaError_t __cudaGetKernel(cudaKernel_t* kernel, const void* fun) {
  *kernel = reinterpret_cast<cudaKernel_t>(const_cast<void*>(fun));
  return cudaSuccess;
}

cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 gridDim, dim3 blockDim, void** args,
                               size_t sharedMem, cudaStream_t) {
  record(reinterpret_cast<const void*>(kernel), gridDim, blockDim, sharedMem, 0, args);
  return cudaSuccess;
}

cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t* config, const void* func,
                                void** args) {
  record(func, config->gridDim, config->blockDim, config->dynamicSmemBytes, 1, args);
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = 132;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = 232448;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor:
      *value = 9;
      return cudaSuccess;
    default:
      std::fprintf(stderr, "fake_cudart: device attribute %d not described\n",
                   static_cast<int>(attr));
      std::exit(3);
  }
}

cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void*) {
  std::memset(attr, 0, sizeof(*attr));
  attr->ptxVersion = 90;
  attr->binaryVersion = 90;
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void*, cudaFuncAttribute, int) { return cudaSuccess; }

cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* numBlocks, const void*,
                                                                   int, size_t, unsigned int) {
  *numBlocks = 2;
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) { return cudaSuccess; }

cudaError_t cudaGetSymbolAddress(void** devPtr, const void* symbol) {
  *devPtr = const_cast<void*>(symbol);  // any stable address will do: nothing runs
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t, enum cudaStreamCaptureStatus* status) {
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }

}  // extern "C"
