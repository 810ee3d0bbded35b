#include "shardflow/etcd_store.hpp"
#include "shardflow/store.hpp"

namespace shardflow {

std::unique_ptr<Store> connect_store(const StoreRendezvous& where) {
  if (where.etcd_endpoints.empty()) return std::make_unique<TcpStoreClient>(where.store_host, where.store_port, where.token, where.timeout);
  EtcdOptions o;
  o.endpoints = where.etcd_endpoints;
  o.user = where.etcd_user;
  o.password = where.token;
  o.root = where.etcd_root;
  o.timeout = where.timeout;
  return std::make_unique<EtcdStore>(std::move(o));
}

}  // namespace shardflow
